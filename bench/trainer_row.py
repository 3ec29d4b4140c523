"""The real trainer in the GPU suite: `train.py` under torchrun on one device, with local data.

    python bench/trainer_row.py resume --scale 100m --families mhar,baseline --graphs --mask block_causal --out T.md
    python bench/trainer_row.py graphs --scale 1b --families mhar,mhar-grouped --out TABLE.md
    python bench/trainer_row.py graphs --scale 1b --families mhar,mhar-grouped --compile --out TABLE.md

Families: a config's name (`train_configs/<family>_<scale>.toml`), or `mhar-grouped`: the `mhar`
config with `model.routing_group_size = "auto"` (grouped routing). `--kernel` sets
`model.routing_kernel` (default "triton": the fused kernels), `--mask` `model.attn_mask_type`,
`--compile` per-block `compile.enable`.

`resume`: for each family, `torchrun --standalone --nproc_per_node=1 train.py --config
train_configs/<family>_<scale>.toml` on the local Shakespeare sample (`data/shakespeare`, the
config's own tokenizer from the offline cache `.cache/tiktoken`), `--steps` steps of micro-batch
`--batch` x `--seq`, logging every step. For the first family it then runs the same job again,
SIGKILLs it (the whole torchrun process group) once the checkpoint of step `--checkpoint-at` is
complete (the launcher and its workers: torchrun starts them in sessions of their own), launches
the same command again (it resumes from that checkpoint, capturing its graph afresh with
`--graphs`) and compares its losses with the straight run's, bitwise, at every step. `--graphs`
turns `training.cuda_graphs` on where CUDA is (the table says whether it was).

`graphs`: for each family the same job `--steps` steps with `training.cuda_graphs` off and on (AC
full, as the 1b recipe), losses at every logged step compared bitwise, and the median time per
step of each, host-inclusive (wall time between logged steps: the eager step's host work, and the
graph replays' with the eager optimizer step around them). Needs CUDA; elsewhere the graphs half
is reported as not run (the eager half still runs, so the row's command is tested on CPU). With
`--compile` both halves compile every block (the warm-up micro-batch of the graphs half compiles,
then the capture); at 1b that is up to one graph per depth (36, parallel.py) per family, minutes on
a fresh machine by estimate (not measured), so the GPU suite's window leaves this variant out: run
it on its own.

`--tiny`: the debug configs at toy sizes (the CI test's CPU run of the suite; `--compile` then
uses the aot_eager backend). The packages the
trainer needs beyond the GPU machine's image (torchdata, tomli-w: `bench/gpu_wheels.txt`) are
installed from `.whl/` (made by `bench/gpu_wheels.sh`) into `<runs>/site` when missing. Every
table is written as its measurements finish; the process exits 1 when a check fails.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "shakespeare"
NEEDED = ("torchdata", "tomli_w")  # importable names of bench/gpu_wheels.txt


def environment(runs: Path) -> dict:
    """The children's environment: offline, the tiktoken cache, and the carried wheels when needed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
    missing = [m for m in NEEDED if subprocess.run([sys.executable, "-c", f"import {m}"], env=env,
                                                    capture_output=True).returncode]
    if missing:
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if not wheels:
            raise SystemExit(f"missing {', '.join(missing)} and no wheels in {ROOT / '.whl'}: run bench/gpu_wheels.sh "
                             "on a machine with pip access and carry .whl")
        site = runs / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


VARIANTS = {"mhar-grouped": ("mhar", ("--model.routing_group_size=auto",))}
"""Families that are a config with overrides: name -> (config family, overrides)."""


def job_argv(a, family: str, name: str, *extra: str) -> list[str]:
    base, overrides = VARIANTS.get(family, (family, ()))
    config = ROOT / "train_configs" / (f"debug_{base}.toml" if a.tiny else f"{base}_{a.scale}.toml")
    compiled = ["--compile.enable=true"] + (["--compile.backend=aot_eager"] if a.tiny else []) if a.compile else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        str(ROOT / "train.py"), "--config", str(config), f"--job.dump_folder={a.runs}", f"--job.name={name}",
        "--data.source=local", f"--data.files=[\"{SAMPLE}/train-*.parquet\"]",
        f"--data.validation_files=[\"{SAMPLE}/validation-*.parquet\"]", "--data.sharding=window",
        f"--training.steps={a.steps}", f"--training.local_batch_size={a.batch}", f"--training.seq_len={a.seq}",
        "--training.global_batch_size=-1", "--validation.enable=false", f"--metrics.log_freq={a.log_freq}",
        "--metrics.disable_color_printing=true", "--metrics.enable_tensorboard=false", "--metrics.enable_wandb=false",
        "--lr_scheduler.warmup_steps=5", f"--activation_checkpoint.mode={a.ac}",
        *([f"--model.routing_kernel={a.kernel}"] if a.kernel else []),
        *([f"--model.attn_mask_type={a.mask}"] if a.mask else []), *compiled, *overrides, *extra,
    ]


def command(a) -> str:
    """The row's command line, for its notes (the flags that change the job)."""
    flags = [f"--scale {a.scale}", f"--families {','.join(a.families)}", f"--ac {a.ac}"]
    flags += [f"--kernel {a.kernel}"] if a.kernel else []
    flags += [f"--mask {a.mask}"] if a.mask else []
    flags += [f for f, on in (("--graphs", a.graphs), ("--compile", a.compile), ("--tiny", a.tiny)) if on]
    return f"`python bench/trainer_row.py {a.mode} {' '.join(flags)}`"


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run: Path) -> dict[int, object]:
    return {r["step"]: r["loss"] for r in rows(run) if "loss" in r}


def step_ms(run: Path, a) -> float | None:
    """Median wall time per step (ms) from the logged throughput, past the first two logs (warm-up)."""
    rates = [r["tokens_per_s"] for r in rows(run) if "tokens_per_s" in r][2:]
    return 1e3 * a.batch * a.seq / statistics.median(rates) if rates else None


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, deepest first (from /proc: torchrun starts its workers in
    sessions of their own, so killing its process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    order, stack = [], [pid]
    while stack:
        p = stack.pop()
        order.append(p)
        stack += children.get(p, [])
    return order[::-1]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it, and wait until they are gone."""
    tree = process_tree(proc.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in tree) \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"


def launch(argv, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def run_to_end(argv, env, log: Path, budget_s: float) -> int:
    proc = launch(argv, env, log)
    try:
        return proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return 124


def kill_after_checkpoint(argv, env, log: Path, run: Path, step: int, budget_s: float) -> int | None:
    """Launch, SIGKILL the process group once checkpoints/step-<step> is complete; the last logged
    step at the kill (None when the run ended first)."""
    from mhar_titan.checkpoint.layout import is_complete  # reads the folder only (no torch)

    proc, deadline = launch(argv, env, log), time.monotonic() + budget_s
    folder = run / "checkpoints" / f"step-{step}"
    while time.monotonic() < deadline and proc.poll() is None:
        if folder.is_dir() and is_complete(folder):
            kill_tree(proc)
            return max(losses(run), default=0)
        time.sleep(0.02)
    if proc.poll() is None:
        kill_tree(proc)
    return None


def table(path: Path, title: str, header: list[str], body: list[list], notes: list[str]) -> None:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    path.write_text("\n".join(lines + [""] + notes) + "\n")


def resume_row(a, env) -> bool:
    import torch

    body, ok = [], True
    header = ["family", "steps", "batch", "loss step 1", f"loss step {a.steps}", "step ms (median)", "tokens/s",
              "kill and resume"]
    graphs = a.graphs and torch.cuda.is_available()
    notes = [f"{command(a)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; training.cuda_graphs "
             + ("on" if graphs else "off" + (" (needs CUDA)" if a.graphs else ""))]
    for k, family in enumerate(a.families):
        run, log = a.runs / f"{family}-straight", a.runs / f"{family}-straight.log"
        on = f"--training.cuda_graphs={'true' if graphs else 'false'}"
        code = run_to_end(job_argv(a, family, run.name, "--checkpoint.enable=false", on), env, log, a.budget_s)
        got = losses(run)
        ms = step_ms(run, a)
        verdict = "not run"
        if k == 0 and code == 0:
            killed = a.runs / f"{family}-killed"
            argv = job_argv(a, family, killed.name, "--checkpoint.enable=true", on,
                            f"--checkpoint.interval={a.checkpoint_at}", "--checkpoint.keep_latest_k=2")
            at = kill_after_checkpoint(argv, env, a.runs / f"{killed.name}.log", killed, a.checkpoint_at, a.budget_s)
            resumed = run_to_end(argv, env, a.runs / f"{killed.name}.log", a.budget_s)
            again = losses(killed)
            same = resumed == 0 and at is not None and at < a.steps and again == got and len(got) == a.steps
            verdict = (f"killed at step {at}, resumed from {a.checkpoint_at}: losses bitwise equal at all "
                       f"{len(got)} steps" if same else
                       f"FAILED (kill at {at}, resume exit {resumed}, {sum(again.get(s) == v for s, v in got.items())}"
                       f" of {len(got)} steps equal)")
            ok &= same
        ok &= code == 0 and len(got) == a.steps
        tokens_s = f"{1e3 * a.batch * a.seq / ms:,.0f}" if ms else "n/a"
        body.append([family, f"{len(got)} of {a.steps}" + ("" if code == 0 else f" (exit {code})"),
                     f"{a.batch} x {a.seq}", got.get(1, "n/a"), got.get(a.steps, "n/a"),
                     f"{ms:.1f}" if ms else "n/a", tokens_s, verdict])
        table(a.out, f"Trainer under torchrun, {a.scale if not a.tiny else 'debug'}", header, body, notes)
    return ok


def graphs_row(a, env) -> bool:
    """Per family: the job with training.cuda_graphs off, then on (CUDA only), losses compared bitwise."""
    import torch

    header = ["family", "training.cuda_graphs", "steps", "batch", f"loss step {a.steps}", "step ms (median)",
              "losses"]
    notes = [f"{command(a)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Step ms: median wall time per "
             "step between logged steps, host included (eager: the whole step; graphs: the replays and the eager "
             "optimizer step around them)."]
    body, ok = [], True
    for family in a.families:
        eager = None
        for on in (False, True):
            if on and not torch.cuda.is_available():
                body.append([family, "on", "not run (needs CUDA)", "", "", "", ""])
                table(a.out, f"CUDA graphs, {a.scale if not a.tiny else 'debug'}", header, body, notes)
                continue
            run = a.runs / f"{family}-graphs-{'on' if on else 'off'}"
            code = run_to_end(job_argv(a, family, run.name, "--checkpoint.enable=false",
                                       f"--training.cuda_graphs={'true' if on else 'false'}"),
                              env, a.runs / f"{run.name}.log", a.budget_s)
            got, ms = losses(run), step_ms(run, a)
            finished = code == 0 and len(got) > 0
            if not on:
                eager = got if finished else None
                verdict = "reference" if finished else "FAILED"
            else:
                verdict = ("bitwise equal to eager" if eager and got == eager else
                           f"DIFFER ({sum(eager.get(s) == v for s, v in got.items())} of {len(got)} equal)"
                           if eager and finished else "FAILED")
            ok &= finished and (not on or got == eager)
            body.append([family, "on" if on else "off", f"{a.steps} ({len(got)} logged)" if code == 0 else
                         f"exit {code}", f"{a.batch} x {a.seq}", got.get(a.steps, "n/a"),
                         f"{ms:.1f}" if ms else "n/a", verdict])
            table(a.out, f"CUDA graphs, {a.scale if not a.tiny else 'debug'}", header, body, notes)
    return ok


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from mhar_titan.cli_args import ArgumentParser, positive_float, positive_int

    p = ArgumentParser(prog="bench/trainer_row.py", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("resume", "graphs"))
    p.add_argument("--scale", default="100m")
    p.add_argument("--families", default="mhar,baseline")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--checkpoint-at", type=positive_int, default=10, help="resume: the checkpoint step the kill follows")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=1024)
    p.add_argument("--ac", default=None, help="activation_checkpoint.mode (default: none for resume, full for graphs)")
    p.add_argument("--kernel", choices=("eager", "compile", "triton", "auto"), default=None,
                   help="model.routing_kernel (default: the config's)")
    p.add_argument("--mask", choices=("causal", "block_causal"), default=None,
                   help="model.attn_mask_type (default: the config's)")
    p.add_argument("--compile", action="store_true", help="compile.enable = true (per-block torch.compile)")
    p.add_argument("--graphs", action="store_true", help="resume: training.cuda_graphs = true (where CUDA is)")
    p.add_argument("--tiny", action="store_true", help="debug configs at toy sizes (CPU)")
    p.add_argument("--runs", type=Path, default=None, help="run folders (default: next to --out)")
    p.add_argument("--budget-s", type=positive_float, default=300, help="limit per launch")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.families = a.families.split(",")
    a.ac = a.ac or ("full" if a.mode == "graphs" else "none")
    if a.tiny:
        a.batch, a.seq = 2, 32
    a.steps = a.steps or (30 if a.mode == "resume" else 20)
    if a.mode == "resume" and a.checkpoint_at >= a.steps:
        p.error(f"argument --checkpoint-at: {a.checkpoint_at} must be below --steps ({a.steps}): the kill follows it")
    a.log_freq = 1 if a.mode == "resume" else 5
    a.runs = (a.runs or a.out.with_suffix(".runs")).resolve()
    a.runs.mkdir(parents=True, exist_ok=True)
    env = environment(a.runs)
    ok = resume_row(a, env) if a.mode == "resume" else graphs_row(a, env)
    print(a.out.read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the checkout's package: the GPU machine runs this with nothing installed
    from mhar_titan.cli_args import run_command

    run_command(main)
