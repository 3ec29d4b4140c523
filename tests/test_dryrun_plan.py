"""The dry run plans the target's job, not the planning machine's, and refuses what train.py refuses.

* The GPU plan (routing path, memory estimate, step-time verdict) is the same whether or not this
  machine has triton installed: a GPU job plans with the fused kernels where they fit, and the
  dry run says which routing path it planned and why.
* The host-bound verdict gives no advice that does not apply: none about CUDA graphs when they are
  on, no host times measured on the Triton path for a job that routes eagerly, and a larger local
  batch whenever one keeps the global batch.
* A job train.py refuses with exit 2 before building anything, the dry run refuses with exit 2.
"""
from __future__ import annotations

import re

import pytest

from mhar_titan.components import performance
from mhar_titan.config import ConfigError, load_config
from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory, report
from slurm_tools import ROOT

MHAR_1B = str(ROOT / "train_configs" / "mhar_1b.toml")
BASELINE_1B = str(ROOT / "train_configs" / "baseline_1b.toml")
DEBUG = str(ROOT / "train_configs" / "debug_mhar.toml")

# A fresh interpreter in which `import triton` fails, as on a machine where it is not installed.
WITHOUT_TRITON = "import sys; sys.modules['triton'] = None; from mhar_titan.dryrun import main; sys.exit(main(sys.argv[1:]))"
WITH_TRITON_IF_ANY = "import sys; from mhar_titan.dryrun import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture
def dry_run(warm_python):
    """``dry_run(code, *argv)``: ``python -c CODE ARGV`` in a process of its own (forked from the warm
    interpreter, which has not imported triton: tests/warm_python.py)."""
    return lambda code, *argv: warm_python.run(["-c", code, *argv], timeout=300)


def test_the_gpu_plan_does_not_depend_on_whether_this_machine_has_triton(dry_run):
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


def test_a_grouped_gpu_plan_needs_no_triton_either(dry_run):
    """Grouped routing's step-time model takes the fused kernels' layout (sites per program) from
    `mhar_kernels.contract`, not from the Triton modules."""
    argv = ("--config", MHAR_1B, "--world-size", "8", "--model.routing_group_size=4")
    without = dry_run(WITHOUT_TRITON, *argv)
    assert without.returncode == 0, without.stderr
    assert dry_run(WITH_TRITON_IF_ANY, *argv).stdout == without.stdout
    assert re.search(r"GPU +[\d.]+ ms  modelled", without.stdout), without.stdout


def test_a_cpu_dry_run_is_the_trainers_own_fit_check():
    """On CPU the dry run plans what the trainer runs here, so its number is the one the trainer's
    start-up check (``estimate_memory`` with the routing that runs on this machine) compares."""
    cfg = load_config(DEBUG, ["--training.local_batch_size=4"])
    text, _ = report(cfg, 2, "cpu", (64 * 2**30, "test"))
    trainer = estimate_memory(build_meta_model(build_model_args(cfg)), cfg, 2, "cpu")
    assert f"  {'total':<16}{trainer.total / 2**30:>10.2f} GiB" in text, text


def step_lines(text: str) -> str:
    return text[text.index("step time per micro-batch"):text.index("resolved config:")]


def test_with_cuda_graphs_on_the_verdict_does_not_advise_turning_them_on():
    text, _ = report(load_config(BASELINE_1B, ["--training.cuda_graphs=true", "--training.local_batch_size=1"]), 8,
                     "cuda")
    step = step_lines(text)
    assert "cuda_graphs = true replays" in step and "host-bound" not in step and "to change" not in step, step
    # the same job without graphs is host-bound and is told about graphs
    plain = step_lines(report(load_config(BASELINE_1B, ["--training.local_batch_size=1"]), 8, "cuda")[0])
    assert "host-bound" in plain and "training.cuda_graphs = true" in plain, plain


def test_graphs_are_advised_only_as_the_graph_check_would_take_them():
    """Advice the trainer would refuse is no advice: a routed 1b job with a setting graphs cannot
    capture (the RNG state saved by checkpointing) is told that graphs refuse it today and why (the
    same sentences `check_cuda_graphs` gives); the baseline, which they capture, is told to turn them on."""
    from mhar_titan.components.cuda_graphs import capture_blockers, check_cuda_graphs

    cfg = load_config(MHAR_1B, ["--training.local_batch_size=1", "--activation_checkpoint.preserve_rng_state=true"])
    step = step_lines(report(cfg, 8, "cuda")[0])
    blockers = capture_blockers(cfg, build_model_args(cfg))
    assert "host-bound" in step and blockers and all(b in step for b in blockers), step
    assert "CUDA graphs (training.cuda_graphs = true)" not in step
    graphed = load_config(MHAR_1B, ["--training.local_batch_size=1", "--training.cuda_graphs=true",
                                    "--activation_checkpoint.preserve_rng_state=true"])
    with pytest.raises(ConfigError, match="cannot capture this job"):
        check_cuda_graphs(graphed, build_model_args(graphed), cuda_available=True)
    base = step_lines(report(load_config(BASELINE_1B, ["--training.local_batch_size=1"]), 8, "cuda")[0])
    assert "CUDA graphs (training.cuda_graphs = true)" in base and "refuses it today" not in base, base


def test_eager_routing_gets_no_host_time_measured_on_the_triton_path():
    for kernel in ("eager", "compile"):
        step = step_lines(report(load_config(MHAR_1B, [f"--model.routing_kernel={kernel}"]), 8, "cuda")[0])
        assert "measured (bench/step_host.py" not in step and "verdict" not in step, step
        assert f"measured on the fused Triton routing path; this job routes on the {kernel} path" in step, step
    # the baseline has no routing: its host time does not depend on the routing kernel
    step = step_lines(report(load_config(BASELINE_1B, ["--model.routing_kernel=eager"]), 8, "cuda")[0])
    assert "verdict" in step, step


def test_the_hint_offers_every_local_batch_that_keeps_the_global_batch():
    """8 ranks x local 1 x accumulation 6 = 48 sequences: local batches 2, 3 and 6 keep the global batch
    (6 covers the host time); 8 ranks x local 1 x accumulation 2: local 2 keeps it but does not cover."""
    args = build_model_args(load_config(MHAR_1B, []))
    host = performance.HOST_STEP_MS[("1b", "mhar", "full")]
    gpu = {k: performance.modelled_gpu_ms(args, k, 1024, "full")["total_ms"] for k in (1, 2, 3, 6)}
    assert gpu[3] < host <= gpu[6]  # the figures the expectations below rest on

    six = step_lines(report(load_config(MHAR_1B, ["--training.local_batch_size=1",
                                                  "--training.global_batch_size=48"]), 8, "cuda")[0])
    assert "no larger local batch" not in six, six
    assert ("training.local_batch_size = 6 with gradient accumulation 1 (the same global batch of 48 sequences), "
            "or CUDA graphs") in six, six

    two = step_lines(report(load_config(MHAR_1B, ["--training.local_batch_size=1",
                                                  "--training.global_batch_size=16"]), 8, "cuda")[0])
    assert "no larger local batch" not in two, two
    assert (f"training.local_batch_size = 2 with gradient accumulation 1 (the same global batch of 16 sequences): "
            f"still host-bound by {host / gpu[2]:.2f}x") in two, two

    # no accumulation left: only then does no larger local batch keep the global batch
    none = step_lines(report(load_config(MHAR_1B, ["--training.local_batch_size=1",
                                                   "--training.global_batch_size=8"]), 8, "cuda")[0])
    assert "no larger local batch keeps the global batch of 8 sequences at 8 ranks" in none, none


@pytest.mark.parametrize("overrides", [
    ["--training.seq_len=4096", "--model.max_seq_len=512"],          # ConfigError from the model arguments
    ["--model.flavor=nope"],                                          # unknown flavor
    ["--training.local_batch_size=3", "--training.global_batch_size=8"],  # batch geometry
    ["--training.steps=0"],                                           # a section's own check
    ["--job.dump_folder=RUN_FOLDER_UNDER_A_FILE"],                    # the run folder cannot be created
])
def test_the_dry_run_exits_2_where_train_py_exits_2(overrides, tmp_path, capsys):
    from mhar_titan.dryrun import main as dry_main
    from mhar_titan.train import main as train_main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    overrides = [o.replace("RUN_FOLDER_UNDER_A_FILE", str(blocker / "runs")) for o in overrides]
    argv = ["--config", DEBUG, f"--job.dump_folder={tmp_path / 'out'}", *overrides]
    assert train_main(argv) == 2
    trained = capsys.readouterr().err
    assert dry_main(argv) == 2, trained
    err = capsys.readouterr().err
    assert err.startswith("dry run: invalid job: ") and len(err.strip().splitlines()) == 1, err
