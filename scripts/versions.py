"""Print the versions of the packages the project's tests touch, one `name==version` a line, or
check that this Python can install a lock file.

    python scripts/versions.py                             # what this environment installed
    python scripts/versions.py --lock requirements/lock.txt  # exit 2 unless the lock's Python matches

Used by `make test-latest` and `make lock` (which versions a run tested), by .ci/run, and by the
Makefile before it installs with the lock (a lock made with Python 3.11 pins wheels, numpy 2.4
for one, that Python 3.10 cannot install: pip's "no matching distribution" would hide why).
"""
import argparse
import importlib.metadata
import pathlib
import platform
import re
import sys

# The distributions whose APIs the project calls (pyproject.toml's dependencies and test extras).
NAMES = ("torch", "triton", "numpy", "datasets", "torchdata", "tiktoken", "transformers", "tokenizers",
         "huggingface-hub", "safetensors", "kernels", "lm-eval", "scipy", "wandb", "tensorboard", "matplotlib",
         "pytest")


def versions() -> dict[str, str]:
    """{distribution: installed version or "not installed"} for NAMES, and the Python version."""
    found = {"python": platform.python_version()}
    for name in NAMES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def lock_python(lock: str) -> str | None:
    """The Python version (major.minor) the lock file says it was made with (its `# python X.Y`
    line), None where it has no `# python` line.

    Raises:
        OSError: the file cannot be read. ValueError: a `# python` line that is not X.Y."""
    with open(lock, encoding="utf-8") as f:
        for line in f:
            if re.match(r"#\s*python\b", line.strip()):
                found = re.fullmatch(r"#\s*python\s+(\d+\.\d+)", line.strip())
                if not found:
                    raise ValueError(f"{lock}: the line {line.strip()!r} should read '# python X.Y' (e.g. 3.11)")
                return found.group(1)
    return None


def check_lock(lock: str) -> str | None:
    """None when this Python can install ``lock``, else the one-line reason (and what to do)."""
    try:
        wanted = lock_python(lock)
    except OSError as e:
        return f"cannot read the lock file {lock}: {e.strerror or e}; restore it (git checkout {lock}) or pass LOCK="
    except ValueError as e:
        return str(e)
    have = ".".join(platform.python_version_tuple()[:2])
    if wanted is None or wanted == have:
        return None
    return (f"{lock} pins the versions tested with Python {wanted}, and this is Python {have}: install the newest "
            f"versions pyproject.toml allows instead with `make setup LOCK=` (or run make with PYTHON=python{wanted})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/versions.py", description=__doc__.splitlines()[0])
    parser.add_argument("--lock", metavar="FILE", help="exit 2 with one line unless this Python can install FILE")
    args = parser.parse_args(argv)
    if args.lock is not None:
        problem = check_lock(args.lock)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        return 0
    for name, version in versions().items():
        print(f"{name}=={version}" if version != "not installed" else f"{name}: not installed")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout's package, before it is installed
    from mhar_titan.cli_args import run_command

    run_command(main)
