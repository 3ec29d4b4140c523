"""Training entry point: ``python train.py --config train_configs/NAME.toml [--section.key=value ...]``.

Also under ``torchrun --nproc_per_node=N train.py ...``. See ``mhar_titan/train.py``.
"""
import sys

from mhar_titan.train import main

if __name__ == "__main__":
    sys.exit(main())
