"""2-rank in-training evaluation, run by tests/test_train_downstream.py under torchrun:

    torchrun --nproc_per_node=2 tests/downstream_eval_worker.py OUT_DIR

Trains the same 4-step debug run twice in OUT_DIR, "plain" and "evaluated" (the ``[eval]`` tasks at
the last step, a checkpoint there), from the repository root (the task files' paths are relative
to it). The process group is shared by the runs and destroyed by the last one (clean gloo exit).
"""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import ROOT  # noqa: E402
from train_common import debug_cfg  # noqa: E402

from mhar_titan.train import Trainer  # noqa: E402


def main(out):
    os.chdir(ROOT)
    common = ["--training.steps=4", "--training.local_batch_size=4", "--training.global_batch_size=8",
              "--checkpoint.enable=true", "--checkpoint.interval=4"]
    evaluated = ["--eval.enable=true", "--eval.tasks=shakespeare_choice,shakespeare_rolling",
                 "--eval.include_path=eval_tasks", "--eval.local_batch_size=4", "--eval.freq=100"]
    for i, (name, extra) in enumerate((("plain", []), ("evaluated", evaluated))):
        trainer = Trainer(debug_cfg(out, name, *common, *extra))
        trainer.train()
        trainer.close(destroy_process_group=i == 1)


if __name__ == "__main__":
    main(sys.argv[1])
