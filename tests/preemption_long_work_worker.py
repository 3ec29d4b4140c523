"""2-rank stop signal during validation, run by tests/test_preemption_long_work.py under torchrun:

    torchrun --nproc_per_node=2 tests/preemption_long_work_worker.py OUT_DIR

Trains the same 4-step debug run (validation at steps 2 and 4) as "straight", then as "stopped"
where only rank 1 gets SIGTERM, as it reads its second validation batch at step 2, then resumes
"stopped" to step 4. Each rank writes the validation batches it read in the stopped run to
OUT_DIR/read-<rank>.json. The process group is shared by the runs and destroyed by the last one.
"""
import json
import os
import pathlib
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_common import debug_cfg  # noqa: E402

from mhar_titan.train import Trainer  # noqa: E402

ARGS = ["--training.steps=4", "--training.local_batch_size=2", "--checkpoint.enable=true",
        "--checkpoint.interval=100", "--validation.enable=true", "--validation.freq=2", "--validation.sequences=12",
        "--validation.local_batch_size=1"]


def main(out):
    rank = int(os.environ["RANK"])
    runs = ("straight", "stopped", "stopped")
    for i, name in enumerate(runs):
        trainer = Trainer(debug_cfg(out, name, *ARGS))
        read = []
        if i == 1:
            source = trainer.val_loader[""]

            class SignalOnRank1:  # rank 1's validation set, sending SIGTERM to rank 1 as its batch 1 is read
                def __iter__(self):
                    for k, batch in enumerate(source):
                        read.append(k)
                        if k == 1 and rank == 1:
                            os.kill(os.getpid(), signal.SIGTERM)
                        yield batch

            trainer.val_loader[""] = SignalOnRank1()
        trainer.train()
        if i == 1:
            pathlib.Path(out, f"read-{rank}.json").write_text(json.dumps(
                {"read": read, "step": trainer.state.step, "preempted": trainer.preempted}))
        trainer.close(destroy_process_group=i == len(runs) - 1)


if __name__ == "__main__":
    main(sys.argv[1])
