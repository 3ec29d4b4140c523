"""torchrun entry of tests/test_say_once.py: ``train.py``'s ``main`` with two faults a test can switch on.

* ``MHAR_TEST_WARN=1``: the config check issues one Python warning on every rank (as a library
  would: the same text everywhere);
* ``MHAR_TEST_DATA_ERROR_RANK<r>=MESSAGE``: rank r's data check raises ``DataError(MESSAGE)``
  (as a node whose copy of a data file is bad).

Everything else is the trainer's own code path.
"""
import os
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mhar_titan import train  # noqa: E402
from mhar_titan.data import DataError  # noqa: E402

rank = os.environ.get("RANK", "0")
if os.environ.get("MHAR_TEST_WARN") == "1":
    check_config = train.check_config

    def warning_check_config(cfg):
        warnings.warn("a warning every rank meets in the same words", UserWarning)
        return check_config(cfg)

    train.check_config = warning_check_config
message = os.environ.get(f"MHAR_TEST_DATA_ERROR_RANK{rank}")
if message:
    def failing_check(*args, **kwargs):
        raise DataError(message)

    train.check_data_files = failing_check

sys.exit(train.main())
