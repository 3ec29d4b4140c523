"""Every command-line entry point ends quietly when its output is piped into a reader that stops early
(``python -m mhar_titan.models | head -1``): no BrokenPipeError traceback, exit status
``cli_args.BROKEN_PIPE_EXIT`` (1). One handler owns this, ``mhar_titan.cli_args.run_command``, and every
``if __name__ == "__main__":`` block of the project calls it (checked by reading every script)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from helpers import PATIENCE_S, ROOT, no_install_argv

from mhar_titan.cli_args import BROKEN_PIPE_EXIT

# Scripts that cannot use the handler. kernels/ (mhar_kernels) imports nothing of mhar_titan; tests/ holds
# the workers the tests launch, not commands.
EXEMPT_FOLDERS = {"tests", "kernels", "outputs", "data"}


def _scripts() -> list:
    """Every .py file of the checkout outside hidden folders (.venv, .git) and EXEMPT_FOLDERS."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in EXEMPT_FOLDERS or any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        found.append(path)
    return found


def _main_block(tree: ast.Module):
    """The module-level ``if __name__ == "__main__":`` statement, or None."""
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)):
            return node
    return None


def test_every_entry_point_runs_its_main_through_the_shared_handler():
    entry_points, missing = [], []
    for path in _scripts():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        block = _main_block(tree)
        name = str(path.relative_to(ROOT))
        if block is None:
            if path.name == "__main__.py":  # `python -m package` runs the file's top level: it must have the block
                missing.append(f"{name}: no `if __name__ == \"__main__\":` block")
            continue
        entry_points.append(name)
        last = block.body[-1]
        if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                and isinstance(last.value.func, ast.Name) and last.value.func.id == "run_command"):
            missing.append(f"{name}: its __main__ block does not end in run_command(main, ...)")
    assert not missing, "\n".join(missing)
    # the search found the commands it is meant to find (a broken walk would find none and pass)
    for expected in ("train.py", "mhar_titan/models/__main__.py", "mhar_titan/experiments/__main__.py",
                     "mhar_titan/dryrun.py", "mhar_titan/train.py", "scripts/versions.py", "bench/routing.py"):
        assert expected in entry_points, expected


def _into_closed_pipe(args: list[str], buffered: bool) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` with stdout a pipe whose reading end is closed before the command starts (the
    reader, as ``head -1`` after its line, has gone: every write finds it so; no race with the command's
    speed). ``buffered``: stdout block-buffered (the error comes at the final flush), else unbuffered
    (it comes from the first print, inside main)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([sys.executable, *args], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, env=env, timeout=PATIENCE_S)
    finally:
        os.close(write_end)


COMMANDS = {
    "models": ["-m", "mhar_titan.models"],
    "experiments list": ["-m", "mhar_titan.experiments", "list", "train_configs/sweeps/study_bytes.toml"],
    "dryrun": ["-m", "mhar_titan.dryrun", "--config", "train_configs/debug_mhar.toml", "--device", "cpu"],
    "train.py -h": ["train.py", "-h"],
    "scripts/versions.py": ["scripts/versions.py"],
}


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_piped_into_a_closed_reader_ends_quietly_with_status_1(name, buffered):
    done = _into_closed_pipe(COMMANDS[name], buffered)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == BROKEN_PIPE_EXIT == 1, (done.returncode, done.stderr)


def test_a_command_started_with_stdout_closed_keeps_its_exit_status():
    """A command started with stdout closed (``>&-``, a daemon or cron launch: Python sets sys.stdout to None)
    ends with main's status, no traceback; its output goes nowhere, as before the shared handler."""
    done = subprocess.run([sys.executable, "-m", "mhar_titan.models"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=PATIENCE_S,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_a_command_with_a_reader_keeps_its_own_exit_status():
    """The handler changes nothing when stdout is read: the output arrives whole and main's status is the exit
    status (0 here; 2 for a bad flag, before and after)."""
    ok = subprocess.run([sys.executable, "-m", "mhar_titan.models"], cwd=ROOT, capture_output=True, text=True,
                        timeout=PATIENCE_S)
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout.splitlines()[0].split() == ["flavor", "family", "vocab", "total", "non-embedding", "routing",
                                                 "extra"]
    bad = subprocess.run([sys.executable, "-m", "mhar_titan.models", "--nosuch"], cwd=ROOT, capture_output=True,
                         text=True, timeout=PATIENCE_S)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--nosuch" in bad.stderr


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error():
    """A BrokenPipeError from another pipe (a subprocess, a socket) while stdout's reader is there is a real
    failure: its traceback is printed and the exit status is Python's 1, not a quiet stop."""
    code = ("import os\n"
            "from mhar_titan.cli_args import run_command\n"
            "def main():\n"
            "    print('before')\n"
            "    r, w = os.pipe()\n"
            "    os.close(r)\n"
            "    os.write(w, b'x')  # EPIPE: this pipe's reader is gone, stdout's is not\n"
            "run_command(main)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=PATIENCE_S)
    assert done.stdout == "before\n"
    assert done.returncode == 1
    assert "Traceback" in done.stderr and done.stderr.rstrip().endswith("BrokenPipeError: [Errno 32] Broken pipe")


def _imports_the_project_at_the_top(path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    return any(name.split(".")[0] in ("mhar_titan", "mhar_kernels") for name in names)


def test_scripts_that_run_without_an_install_still_find_the_handler(tmp_path):
    """A script outside the package whose own imports need no install of the project (bench/trainer_row.py
    and bench/plain_python.py run so on the GPU machine, scripts/versions.py before `make setup` installs
    anything) finds ``run_command`` in this checkout: it puts the checkout on sys.path before importing it."""
    scripts = [p for p in _scripts() if p.parts[len(ROOT.parts)] != "mhar_titan" and _main_block(ast.parse(p.read_text()))
               and not _imports_the_project_at_the_top(p)]
    names = {str(p.relative_to(ROOT)) for p in scripts}
    assert {"bench/trainer_row.py", "bench/plain_python.py", "scripts/versions.py"} <= names, names
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {str(p.relative_to(ROOT)): subprocess.Popen(
        no_install_argv(p, "--help"), cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in scripts}
    for name, proc in procs.items():
        err = proc.communicate(timeout=PATIENCE_S)[1]
        assert "No module named 'mhar_titan'" not in err, f"{name}:\n{err[-2000:]}"
