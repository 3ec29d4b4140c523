"""Training entry point: ``python train.py --config train_configs/NAME.toml [--section.key=value ...]``.

Also under ``torchrun --nproc_per_node=N train.py ...``. See ``mhar_titan/train.py``.
"""
from mhar_titan.cli_args import run_command
from mhar_titan.train import main

if __name__ == "__main__":
    run_command(main)
