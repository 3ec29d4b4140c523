"""Launch a sweep: one run after another on this machine, or one SLURM job per run.

Local (``run_local``): each run is ``python train.py --config BASE --section.key=value ...`` in a
child process. Before starting a run the launcher reads its run folder:

=============  ==========================================================================
done           ``exit_status`` says ``completed`` at ``training.steps``: skipped
resumable      a complete checkpoint exists: started with the same command, which resumes it
unsaved        metrics rows but no complete checkpoint (stopped before its first save): the
               trainer refuses to overwrite it; reported, the folder is left alone
new            started
=============  ==========================================================================

A run that stops cleanly before its last step (``preempted``: Ctrl-C or SIGTERM reached the
trainer, which saved a checkpoint) stops the sweep: rerunning the same sweep command resumes it
where it stopped. A run that fails (bad input, training health, a crash) is reported and the
sweep goes on with the next run; the launcher then exits 1.

SLURM (``slurm_script``): a bash script with one ``sbatch ... slurm/train.sbatch BASE overrides``
per run that is not done (the job resumes from its run folder like any requeued job).
"""
from __future__ import annotations

import dataclasses
import pathlib
import shlex
import subprocess
import sys
from typing import Callable, Optional, Sequence

from mhar_titan.checkpoint import is_complete, step_folders
from mhar_titan.exit_status import FILE_NAME, read_exit_status
from mhar_titan.experiments.sweep import Run, Sweep

TRAIN_SCRIPT = "train.py"
SBATCH_SCRIPT = "slurm/train.sbatch"


def run_state(run: Run) -> str:
    """"done", "resumable", "unsaved" or "new" (module docstring). Done: ``exit_status`` says
    ``completed`` at ``training.steps``, or (from a trainer that writes no status) a complete
    checkpoint at ``training.steps`` or beyond."""
    steps = run.config.training.steps
    status = read_exit_status(run.run_dir / FILE_NAME)
    if status.get("status") == "completed" and int(status.get("step", -1)) >= steps:
        return "done"
    complete = [step for step, p in step_folders(run.run_dir / run.config.checkpoint.folder).items()
                if is_complete(p)]
    if complete and max(complete) >= steps:
        return "done"
    if complete:
        return "resumable"
    metrics = run.run_dir / run.config.metrics.jsonl_file
    if metrics.is_file() and metrics.read_text().strip():
        return "unsaved"
    return "new"


def train_command(run: Run, python: str = sys.executable) -> list[str]:
    """The command that trains (or resumes) ``run`` from the repository root."""
    return [python, TRAIN_SCRIPT, *run.train_args()]


@dataclasses.dataclass
class SweepReport:
    """What ``run_local`` did, run names per outcome."""

    skipped: list[str] = dataclasses.field(default_factory=list)
    completed: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    unsaved: list[str] = dataclasses.field(default_factory=list)
    stopped: Optional[str] = None
    """The run that stopped cleanly before its last step (the sweep stopped there)."""

    @property
    def ok(self) -> bool:
        return not (self.failed or self.unsaved) and self.stopped is None


def _mtime(path: pathlib.Path) -> Optional[int]:
    return path.stat().st_mtime_ns if path.is_file() else None


def run_child(command: list[str]) -> int:
    """Run a training process to its end and return its exit code. Ctrl-C reaches the child
    too (same process group): the trainer saves and exits, so the launcher waits for it
    instead of killing it."""
    child = subprocess.Popen(command)
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            continue


def run_local(sweep: Sweep, runs: Optional[Sequence[Run]] = None, dry_run: bool = False,
              python: str = sys.executable, runner: Callable[[list[str]], int] = run_child,
              echo: Callable[[str], None] = print) -> SweepReport:
    """Run the sweep's runs (or ``runs``) one after another; see the module docstring.

    dry_run: print each run's state and command, start nothing. runner: runs one command
    and returns its exit code (the training subprocess).
    """
    report = SweepReport()
    runs = sweep.runs if runs is None else runs
    for i, run in enumerate(runs, 1):
        state = run_state(run)
        head = f"[{i}/{len(runs)}] {run.name}: {state}"
        if state == "done":
            echo(f"{head}, skipped")
            report.skipped.append(run.name)
            continue
        if state == "unsaved":
            echo(f"{head}: {run.run_dir} holds metrics but no complete checkpoint, so the trainer cannot resume "
                 "it; move or delete the folder and rerun the sweep")
            report.unsaved.append(run.name)
            continue
        command = train_command(run, python)
        echo(f"{head}: {shlex.join(command)}")
        if dry_run:
            continue
        before = _mtime(run.run_dir / FILE_NAME)
        code = runner(command)
        after = run_state(run)
        # Without a status file from this start the exit code decides: the trainer exits 0 short
        # of its last step only after a stop signal (it saved); anything else is a failure.
        fresh = _mtime(run.run_dir / FILE_NAME) not in (None, before)
        status = read_exit_status(run.run_dir / FILE_NAME).get("status") if fresh else None
        status = status or ("preempted" if code == 0 else "crashed")
        if after == "done":
            report.completed.append(run.name)
        elif code == 0 and status in ("preempted", "completed"):  # a clean stop short of the sweep's last step
            echo(f"{run.name} stopped at a checkpoint before its last step; rerun the same command to resume")
            report.stopped = run.name
            break
        else:
            echo(f"{run.name} failed (exit code {code}, status {status}); going on with the next run")
            report.failed.append(run.name)
    return report


def slurm_script(sweep: Sweep, runs: Optional[Sequence[Run]] = None, sbatch_args: Sequence[str] = ()) -> str:
    """A bash script submitting one ``slurm/train.sbatch`` job per run that is not done.

    Options: the sweep's ``[sweep.slurm] args`` then ``sbatch_args``; each job is named
    ``<sweep name>-<run name>``. The script runs from the repository root.
    """
    runs = sweep.runs if runs is None else runs
    lines = ["#!/usr/bin/env bash",
             f"# Sweep {sweep.name} ({sweep.path}): one SLURM job per run through {SBATCH_SCRIPT}.",
             "# Submit from the repository root: bash THIS_FILE. Resubmitting a run resumes its run folder.",
             "set -euo pipefail",
             f'[[ -f {SBATCH_SCRIPT} ]] || {{ echo "run this from the repository root" >&2; exit 2; }}']
    options = [*sweep.slurm_args, *sbatch_args]
    for run in runs:
        if run_state(run) == "done":
            lines.append(f"# {run.name}: done, not submitted")
            continue
        # train.sbatch takes CONFIG.toml first, then the overrides (no --config).
        command = ["sbatch", f"--job-name={sweep.name}-{run.name}", *options, SBATCH_SCRIPT, run.base, *run.overrides]
        lines.append(shlex.join(command))
    return "\n".join(lines) + "\n"


def world_size_of(sbatch_options: Sequence[str], default_gpus_per_node: int = 8) -> int:
    """Ranks of a ``slurm/train.sbatch`` job: --nodes x --gpus-per-node (the script's defaults 2 x 8)."""
    nodes, gpus = 2, default_gpus_per_node
    for option in sbatch_options:
        key, _, value = option.partition("=")
        if key in ("--nodes", "-N") and value.isdigit():
            nodes = int(value)
        elif key == "--gpus-per-node" and value.split(":")[-1].isdigit():
            gpus = int(value.split(":")[-1])
    return nodes * gpus


def check_runs(runs: Sequence[Run], world_size: int, available: Optional[tuple[int, str]] = None) -> list[str]:
    """The trainer's dry run (``mhar_titan.dryrun.report``) of every run at ``world_size`` ranks:
    config, model on the meta device, batch geometry, memory estimate, and the memory fit where
    ``available`` (bytes per rank, where the number comes from) is given. Returns one summary line
    per run: its memory estimate and the dry run's verdict (``mhar_titan.dryrun.verdict``: "OK"
    only when every check ran, else what was not checked and why).

    Raises:
        ConfigError: a run is invalid at this world size (the message names the run).
        MemoryFitError: a run does not fit ``available`` (the message names the run).
    """
    from mhar_titan.components.memory import MemoryFitError
    from mhar_titan.config import ConfigError
    from mhar_titan.dryrun import report, verdict

    lines = []
    for run in runs:
        try:
            text, warnings = report(run.config, world_size, "cuda", available)
        except ConfigError as e:
            raise ConfigError(f"run {run.name}: {e}") from e
        except MemoryFitError as e:
            raise MemoryFitError(f"run {run.name}: {e}") from e
        total = next(line for line in text.splitlines() if line.strip().startswith("total") and "GiB" in line)
        lines.append(f"{run.name}: at {world_size} ranks, memory estimate {total.split()[-2]} GiB per rank; "
                     f"dry run {verdict(warnings)}")
    return lines


def gpu_hours(run: Run, world_size: int, mfu: float, peak_flops: float) -> float:
    """Estimated GPU-hours of a run: training FLOPs / (MFU x peak FLOP/s), with the FLOPs
    ``mhar_titan.metrics.flops_per_token`` x tokens (steps x global batch x sequence length).
    An estimate until a throughput is measured (the MFU is assumed).

    Raises:
        ValueError: mfu not in (0, 1] or peak_flops <= 0.
    """
    from mhar_titan.components.batches import batch_geometry
    from mhar_titan.dryrun import build_model_args
    from mhar_titan.metrics import flops_per_token

    if not 0 < mfu <= 1 or peak_flops <= 0:
        raise ValueError(f"need 0 < mfu <= 1 and peak_flops > 0, got mfu={mfu}, peak_flops={peak_flops}")
    cfg = run.config
    global_batch, _ = batch_geometry(cfg.training, world_size)
    tokens = cfg.training.steps * global_batch * cfg.training.seq_len
    return flops_per_token(build_model_args(cfg), cfg.training.seq_len).total * tokens / (mfu * peak_flops) / 3600
