"""Acceptance 1 (bash -n, shellcheck) and the command line the per-node launcher builds."""
from __future__ import annotations

import shlex
import subprocess

import pytest

from slurm_tools import ROOT, SCRIPTS, launch_env, require_tool

NODE = ROOT / "slurm" / "torchrun_node.sh"


def test_every_launch_script_exists():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"slurm/train.sbatch", "slurm/torchrun_node.sh", "slurm/ci_setup.sh", "scripts/run_train.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck_clean():
    shellcheck = require_tool("shellcheck", "acceptance 1 lints every launch script")
    r = subprocess.run([shellcheck, "--shell=bash", "--severity=info", *map(str, SCRIPTS)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def node_command(env: dict, *args: str) -> list[str]:
    """The torchrun command torchrun_node.sh would exec (PRINT_CMD=1), as argv."""
    r = subprocess.run(["bash", str(NODE), *args], env=launch_env(PRINT_CMD="1", **env),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    return shlex.split(line.split("] ", 1)[1])


def opt(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}="))


def test_node_command_from_slurm_variables():
    argv = node_command(
        {"RDZV_ENDPOINT": "node001:29123", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3",
         "SLURM_JOB_ID": "777", "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1"},
        "train_configs/x.toml", "--training.steps=5", "--job.description=two words",
    )
    assert argv[1:3] == ["-m", "mhar_titan.torchrun"]
    assert opt(argv, "nnodes") == "4" and opt(argv, "node_rank") == "3"
    assert opt(argv, "nproc_per_node") == "8"  # SLURM_GPUS_ON_NODE wins over CUDA_VISIBLE_DEVICES
    assert opt(argv, "rdzv_backend") == "c10d" and opt(argv, "rdzv_endpoint") == "node001:29123"
    assert opt(argv, "rdzv_id") == "777"
    assert argv[-5:] == [str(ROOT / "train.py"), "--config", "train_configs/x.toml",
                         "--training.steps=5", "--job.description=two words"]


@pytest.mark.parametrize("env, expected", [
    ({"CUDA_VISIBLE_DEVICES": "2,5,7"}, "3"),        # no SLURM GPU count: visible devices
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "1"),           # GPUs hidden: one CPU worker
    ({"CUDA_VISIBLE_DEVICES": ""}, "1"),
    ({}, "1"),                                       # nothing set, no nvidia-smi here
    ({"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}, "2"),  # explicit override
])
def test_workers_per_node(env, expected):
    argv = node_command({"RDZV_ENDPOINT": "127.0.0.1:1", **env}, "c.toml")
    assert opt(argv, "nproc_per_node") == expected


def test_node_launcher_errors_name_the_variable():
    r = subprocess.run(["bash", str(NODE), "c.toml"], env=launch_env(PRINT_CMD="1"), capture_output=True, text=True)
    assert r.returncode != 0 and "RDZV_ENDPOINT" in r.stderr
    r = subprocess.run(["bash", str(NODE), "c.toml"], capture_output=True, text=True,
                       env=launch_env(PRINT_CMD="1", RDZV_ENDPOINT="h:1", NODE_RANK="first"))
    assert r.returncode == 2 and "node_rank must be a non-negative integer, got 'first'" in r.stderr
    r = subprocess.run(["bash", str(NODE)], env=launch_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.parametrize("args, message", [
    ([], "usage: sbatch slurm/train.sbatch CONFIG.toml"),
    (["train_configs/nope.toml"], "config file 'train_configs/nope.toml' not found"),
])
def test_batch_script_rejects_bad_arguments_before_launching(tmp_path, args, message):
    # Run as sbatch would, from a copy of the script, with the submit directory set.
    copy = tmp_path / "slurm_script"
    copy.write_text((ROOT / "slurm" / "train.sbatch").read_text())
    r = subprocess.run(["bash", str(copy), *args], cwd=tmp_path, capture_output=True, text=True,
                       env=launch_env(SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID="9"))
    assert r.returncode == 2 and message in r.stdout, r.stdout + r.stderr


def test_batch_script_needs_the_repository(tmp_path):
    copy = tmp_path / "slurm_script"
    copy.write_text((ROOT / "slurm" / "train.sbatch").read_text())
    r = subprocess.run(["bash", str(copy), "c.toml"], cwd=tmp_path, capture_output=True, text=True,
                       env=launch_env(SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="9"))
    assert r.returncode == 2 and "submit from the repository root or set REPO_DIR" in r.stdout


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, "4"),
    ({"CUDA_VISIBLE_DEVICES": "2,5,7"}, "3"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "1"),
    ({}, "1"),
    ({"NGPU": "2", "CUDA_VISIBLE_DEVICES": "0"}, "2"),
])
def test_single_node_launcher_counts_gpus_like_the_node_launcher(env, expected):
    # PYTHON=echo turns the dry-run exec into a print of its command line
    r = subprocess.run(["bash", str(ROOT / "scripts" / "run_train.sh")], capture_output=True, text=True,
                       env=launch_env(DRY_RUN="1", PYTHON="echo", **env))
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[argv.index("--world-size") + 1] == expected
    if "NGPU" not in env:  # same count (same helper, slurm/lib.sh) as the per-node launcher
        assert opt(node_command({"RDZV_ENDPOINT": "127.0.0.1:1", **env}, "c.toml"), "nproc_per_node") == expected


@pytest.mark.parametrize("with_venv", [True, False])
def test_launchers_default_to_the_repository_venv_python(tmp_path, with_venv):
    # a copy of the launchers in a fake repository, with or without .venv/bin/python
    import shutil

    for name in ("scripts/run_train.sh", "slurm/torchrun_node.sh", "slurm/lib.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    venv_python = tmp_path / ".venv" / "bin" / "python"
    if with_venv:
        venv_python.parent.mkdir(parents=True)
        venv_python.write_text("#!/bin/sh\necho venv-python \"$@\"\n")
        venv_python.chmod(0o755)
    env = launch_env(CUDA_VISIBLE_DEVICES="-1")
    del env["PYTHON"]
    expected = str(venv_python) if with_venv else "python3"
    r = subprocess.run(["bash", str(tmp_path / "slurm" / "torchrun_node.sh"), "c.toml"], capture_output=True,
                       text=True, env=dict(env, PRINT_CMD="1", RDZV_ENDPOINT="127.0.0.1:1"))
    argv = shlex.split(r.stderr.strip().splitlines()[-1].split("] ", 1)[1])
    assert argv[:3] == [expected, "-m", "mhar_titan.torchrun"]  # torchrun (mhar_titan.torchrun) of that same Python
    if with_venv:
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "run_train.sh")], capture_output=True, text=True,
                           env=dict(env, DRY_RUN="1"))
        assert r.returncode == 0 and r.stdout.split()[:3] == ["venv-python", "-m", "mhar_titan.dryrun"], r.stderr
