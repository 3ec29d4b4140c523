"""``train.py`` that also writes each rank's exit status to $CKPT_EXIT_DIR/rank<R>.rc.

Used by tests/test_checkpoint_e2e.py to check that every torchrun worker exits 0 after
SIGTERM (torchrun's own exit status then reports the signal, not the workers').
"""
import os
import sys
from pathlib import Path

from mhar_titan.train import main

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    Path(os.environ["CKPT_EXIT_DIR"], f"rank{os.environ.get('RANK', '0')}.rc").write_text(str(rc))
    sys.exit(rc)
