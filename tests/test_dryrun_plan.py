"""The dry run plans the target's job, not the planning machine's.

The GPU plan (routing path, memory estimate, step-time verdict) is the same whether or not this
machine has triton installed: a GPU job plans with the fused kernels where they fit, and the
dry run says which routing path it planned and why.
"""
from __future__ import annotations

import subprocess
import sys

from mhar_titan.config import load_config
from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory, report
from slurm_tools import ROOT

MHAR_1B = str(ROOT / "train_configs" / "mhar_1b.toml")
BASELINE_1B = str(ROOT / "train_configs" / "baseline_1b.toml")
DEBUG = str(ROOT / "train_configs" / "debug_mhar.toml")

# A fresh interpreter in which `import triton` fails, as on a machine where it is not installed.
WITHOUT_TRITON = "import sys; sys.modules['triton'] = None; from mhar_titan.dryrun import main; sys.exit(main(sys.argv[1:]))"
WITH_TRITON_IF_ANY = "import sys; from mhar_titan.dryrun import main; sys.exit(main(sys.argv[1:]))"


def dry_run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_gpu_plan_does_not_depend_on_whether_this_machine_has_triton():
    argv = ("--config", MHAR_1B, "--world-size", "8")
    without = dry_run(WITHOUT_TRITON, *argv)
    assert without.returncode == 0, without.stderr
    assert dry_run(WITH_TRITON_IF_ANY, *argv).stdout == without.stdout
    out = without.stdout
    # the fused kernels are planned (auto on CUDA, the 1b tile fits), and the plan says so and why
    assert "routing: the triton path on cuda ranks (model.routing_kernel = 'auto' on cuda runs the fused kernels" \
        in out, out
    assert "memory estimate per rank (cuda, bfloat16 compute, routing triton, 8 FSDP ranks" in out, out
    # the estimate printed is the formula with the triton path (no routing keys saved)
    cfg = load_config(MHAR_1B, [])
    model = build_meta_model(build_model_args(cfg))
    planned = estimate_memory(model, cfg, 8, "cuda", routing="triton")
    assert f"  {'total':<16}{planned.total / 2**30:>10.2f} GiB" in out, out
    assert estimate_memory(model, cfg, 8, "cuda", routing="eager").activations > planned.activations
    # the line naming what the estimate covers beside the trainer's own fit check
    assert "covers          the trainer's own fit check (components/memory.py)" in out
    # an eager job plans eager wherever it is planned
    eager = dry_run(WITHOUT_TRITON, *argv, "--model.routing_kernel=eager").stdout
    assert "routing: the eager path on cuda ranks (model.routing_kernel = 'eager')" in eager, eager


def test_a_cpu_dry_run_is_the_trainers_own_fit_check():
    """On CPU the dry run plans what the trainer runs here, so its number is the one the trainer's
    start-up check (``estimate_memory`` with the routing that runs on this machine) compares."""
    cfg = load_config(DEBUG, ["--training.local_batch_size=4"])
    text, _ = report(cfg, 2, "cpu", (64 * 2**30, "test"))
    trainer = estimate_memory(build_meta_model(build_model_args(cfg)), cfg, 2, "cpu")
    assert f"  {'total':<16}{trainer.total / 2**30:>10.2f} GiB" in text, text
