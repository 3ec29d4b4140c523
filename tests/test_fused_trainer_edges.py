"""The fused routing kernels (``model.routing_kernel = "triton"``; on CPU under TRITON_INTERPRET=1)
inside the trainer, with the settings a user combines them with, and the bad inputs around them.

- One small job on documents shorter than a window (so document masking changes the loss; the
  job also restarts RoPE per document), with gradient accumulation (2 micro-batches per step), grouped routing (g = 2),
  delta mode and AC full: the fused run's training and validation losses equal the eager run's to
  1e-5, and a fused run per call (g = 1) resumed from the eager grouped run's DCP checkpoint
  continues the eager run's losses to 1e-5 (routing_kernel and routing_group_size change how the
  model computes, not its weights: ``models.args.WEIGHT_NEUTRAL_FIELDS``).
- Sampling with the KV cache (``generate_batch``) from that checkpoint on the fused path draws the
  eager path's tokens.
- ``training.cuda_graphs = true`` on a CPU run is refused in one line naming the key, exit status 2,
  nothing made, with every routing_kernel x compile.enable x attn_mask_type.
- An unknown routing_kernel and a routing_group_size that is not 1..sites or "auto": one line naming
  the key, exit status 2, nothing made.
- TRITON_INTERPRET=1 set after ``import mhar_titan`` and after the model is built, before its first
  forward (the kernels load on first use: ``mhar_kernels`` docstring), runs the fused per-call and
  grouped kernels, with the eager model's outputs and gradients (a fresh interpreter).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import PATIENCE_S, ROOT, read_metrics  # noqa: E402
from train_common import debug_argv, debug_cfg  # noqa: E402

import mhar_kernels  # noqa: E402
from mhar_titan.train import main, run_training  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
FUSED_ON_CPU = pytest.mark.skipif(
    not mhar_kernels.can_run(torch.device("cpu"), 64, 4),
    reason="the fused kernels do not run on this CPU (TRITON_INTERPRET=1 not set before import)")

SMALL = ("--model.dim=64", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=128",
         "--model.routing_heads=4", "--training.local_batch_size=2", "--training.global_batch_size=4",
         "--lr_scheduler.warmup_steps=1", "--debug.seed=1")
"""debug_mhar at d = 64, 2 layers (5 routing sites), H = 4; 2 micro-batches of 2 x 32 tokens per step."""
JOB = ("--model.attn_mask_type=block_causal", "--model.rope_per_document=true", "--model.routing_mode=delta",
       "--activation_checkpoint.mode=full", "--validation.enable=true", "--validation.freq=2",
       "--validation.sequences=4", "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=4")
TOL = 1e-5  # fp32 losses, fused against eager


def _losses(run_dir) -> tuple[dict, dict]:
    """({step: training loss}, {step: validation loss}) of a run folder's metrics.jsonl."""
    rows = read_metrics(run_dir)
    return ({r["step"]: r["loss"] for r in rows if "loss" in r},
            {r["step"]: r["val_loss"] for r in rows if "val_loss" in r})


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Train and validation parquet files of 3-15-word documents (several per 32-token window)."""
    rng = random.Random(0)
    words = "the king and queen of france went to see a play about love and war in rome".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(300)]
    root = tmp_path_factory.mktemp("short_documents")
    pq.write_table(pa.table({"text": docs[:260]}), root / "train.parquet")
    pq.write_table(pa.table({"text": docs[260:]}), root / "validation.parquet")
    return (f"--data.files=[\"{root / 'train.parquet'}\"]",
            f"--data.validation_files=[\"{root / 'validation.parquet'}\"]")


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory, short_documents):
    """The job on the eager path, grouped (g = 2): its run folder (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("eager")
    run_training(debug_cfg(root, "eager", *SMALL, *short_documents, *JOB, "--model.routing_kernel=eager",
                           "--model.routing_group_size=2"))
    return root / "eager"


@FUSED_ON_CPU
def test_document_masked_accumulated_grouped_delta_job_fused_equals_eager(tmp_path, short_documents, eager_run):
    run_training(debug_cfg(tmp_path, "fused", *SMALL, *short_documents, *JOB, "--model.routing_kernel=triton",
                           "--model.routing_group_size=2"))
    (eager, eager_val), (fused, fused_val) = _losses(eager_run), _losses(tmp_path / "fused")
    assert sorted(eager) == sorted(fused) == [1, 2, 3, 4] and sorted(eager_val) == sorted(fused_val) == [2, 4]
    for step in eager:
        assert fused[step] == pytest.approx(eager[step], abs=TOL), step
    for step in eager_val:
        assert fused_val[step] == pytest.approx(eager_val[step], abs=TOL), step
    # the documents matter: the same job with the causal mask learns another loss
    causal = debug_cfg(tmp_path, "causal", *SMALL, *short_documents, *JOB, "--model.attn_mask_type=causal",
                       "--model.rope_per_document=false", "--training.steps=1", "--validation.enable=false",
                       "--checkpoint.enable=false")
    run_training(causal)
    assert abs(_losses(tmp_path / "causal")[0][1] - eager[1]) > 1e-3


@FUSED_ON_CPU
def test_fused_per_call_run_resumes_the_eager_grouped_checkpoint(tmp_path, short_documents, eager_run):
    run = tmp_path / "resumed"
    shutil.copytree(eager_run, run, ignore=shutil.ignore_patterns("step-4", "metrics.jsonl"))
    run_training(debug_cfg(tmp_path, "resumed", *SMALL, *short_documents, *JOB, "--model.routing_kernel=triton",
                           "--model.routing_group_size=1"))
    (eager, eager_val), (resumed, resumed_val) = _losses(eager_run), _losses(run)
    assert sorted(resumed) == [3, 4] and sorted(resumed_val) == [4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(eager[step], abs=TOL), step
    assert resumed_val[4] == pytest.approx(eager_val[4], abs=TOL)


@FUSED_ON_CPU
def test_kv_cache_sampling_on_the_fused_path_draws_the_eager_tokens(eager_run):
    import mhar_titan as mt

    drawn = {}
    for kernel in ("eager", "triton"):
        run = mt.load_run(eager_run, routing_kernel=kernel)
        assert run.model.args.routing_kernel == kernel
        prompt = run.tokenizer.encode("the king")
        drawn[kernel] = mt.generate_batch(run.model, [prompt, prompt[:1]], 8, n_vocab=run.tokenizer.n_vocab,
                                          temperature=0.8, top_k=40, seed=1)
    assert [len(row) for row in drawn["eager"]] == [8, 8]
    assert drawn["triton"] == drawn["eager"]


def _refused_in_one_line(tmp_path, capsys, name, *overrides) -> str:
    """Run main on debug_mhar with ``overrides``; assert exit 2, one stderr line, no run folder; the line."""
    code = main(debug_argv(tmp_path, name, *overrides))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    assert not (tmp_path / name).exists()  # refused before the run folder was made
    return err[0]


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("compile_", [False, True], ids=["eager_blocks", "compiled_blocks"])
@pytest.mark.parametrize("kernel", ["eager", "compile", "triton", "auto"])
def test_cuda_graphs_on_cpu_is_refused_with_every_kernel_compile_and_mask(tmp_path, capsys, kernel, compile_, mask):
    line = _refused_in_one_line(tmp_path, capsys, "graphs", "--training.cuda_graphs=true",
                                f"--model.routing_kernel={kernel}", f"--compile.enable={str(compile_).lower()}",
                                f"--model.attn_mask_type={mask}")
    assert "'training.cuda_graphs'" in line and "CUDA device" in line and "training.cuda_graphs = false" in line


@pytest.mark.parametrize("override, needles", [
    ("--model.routing_kernel=Triton", ("model.routing_kernel", "'triton'", "'Triton'")),
    ("--model.routing_kernel=fused", ("model.routing_kernel", "'eager', 'compile', 'triton', 'auto'")),
    ("--model.routing_group_size=0", ("model.routing_group_size", "positive integer", "'auto'")),
    ("--model.routing_group_size=-1", ("model.routing_group_size", "positive integer")),
    ("--model.routing_group_size=6", ("model.routing_group_size", "5 routing sites", "choose 1..5")),
    ("--model.routing_group_size=AUTO", ("model.routing_group_size", "'auto'", "'AUTO'")),
    ("--model.routing_group_size=2.0", ("model.routing_group_size", "int or 'auto'")),
])
def test_bad_routing_kernel_or_group_size_is_one_line_naming_the_key(tmp_path, capsys, override, needles):
    line = _refused_in_one_line(tmp_path, capsys, "bad", *SMALL, "--model.routing_kernel=triton", override)
    for needle in needles:
        assert needle in line, (needle, line)


_INTERPRET_AFTER_IMPORT = """
import os, sys
import torch
import mhar_titan as mt
assert "TRITON_INTERPRET" not in os.environ and not any(m.startswith("mhar_kernels.triton") for m in sys.modules)
shape = dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=256, residual="attn_res",
             routing_heads=4, routing_mode="delta", routing_null_source=True)
tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
for group in (1, 2):
    torch.manual_seed(0)
    eager = mt.Transformer(mt.ModelArgs(**shape, routing_group_size=group))
    eager.init_weights()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(0.05 * torch.randn_like(p))  # routing parameters away from their zero init
    fused = mt.Transformer(mt.ModelArgs(**shape, routing_group_size=group, routing_kernel="triton"))
    fused.load_state_dict(eager.state_dict())
    os.environ["TRITON_INTERPRET"] = "1"  # after the import and the build, before the first forward
    outs = []
    for model in (eager, fused):
        out = model(tokens)
        (out.float() ** 2).mean().backward()
        outs.append(out)
    import mhar_kernels
    assert mhar_kernels.dispatch.backend("triton", "cpu", 64, 4) == "triton"
    assert ("mhar_kernels.triton_grouped" in sys.modules) == (group > 1), group
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}, g={group}: {m}")
print("fused after import ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_interpret_set_after_import_and_build_runs_the_fused_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", _INTERPRET_AFTER_IMPORT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=PATIENCE_S)
    assert done.returncode == 0 and "fused after import ok" in done.stdout, done.stderr[-3000:]
