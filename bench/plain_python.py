"""Run a script or module as the GPU machine would: from the plain checkout, without the data stack.

    python bench/plain_python.py SCRIPT.py ARGS...
    python bench/plain_python.py -m MODULE ARGS...

Makes `datasets`, `torchdata`, `tiktoken` and `wandb` unimportable (an accidental import fails
loudly instead of passing on a machine that happens to have them), drops an editable install's
import finder so that `mhar_titan` and `mhar_kernels` come from this checkout, puts the checkout
and its kernels/ folder (which holds the package mhar_kernels/) first on sys.path, then runs the
target as __main__.
"""
import runpy
import sys
from pathlib import Path

BLOCKED = ("datasets", "torchdata", "tiktoken", "wandb")
ROOT = Path(__file__).resolve().parents[1]


def plain_checkout() -> None:
    for name in BLOCKED:
        sys.modules[name] = None  # `import name` raises ImportError
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in repr(h)]
    first = [str(ROOT), str(ROOT / "kernels")]
    sys.path[:] = first + [p for p in sys.path if "__editable__" not in p and p not in first]


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(__doc__)
    plain_checkout()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python SCRIPT` does
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    plain_checkout()  # before the first import of mhar_titan: this checkout's (no install on the GPU machine)
    from mhar_titan.cli_args import run_command

    run_command(main, sys.argv[1:])
