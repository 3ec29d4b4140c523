"""One backend rule (`mhar_kernels.dispatch.backend`) decides every routing call: patched, the
model (per call and grouped), the dry run's memory model, the benchmarks and the analysis all
take the patched choice (issue 20, acceptance 1)."""
from __future__ import annotations

import dataclasses
import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch

from mhar_kernels import dispatch, op, reference, triton_grouped, triton_merge
from mhar_titan.analysis.routing import routing_entropy
from mhar_titan.config import ActivationCheckpoint
from mhar_titan.dryrun import _activation_elements_per_token
from mhar_titan.models.args import ROUTING_KERNELS, ModelArgs
from mhar_titan.models.model import Transformer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import routing_harness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16)


@pytest.fixture
def patched(monkeypatch):
    """backend() replaced by one that answers "eager" and records (kernel, device type); the fused
    kernels refuse to run, so a caller that bypassed the rule would fail."""
    asked = []

    def decide(kernel, device, dim, heads):
        asked.append((kernel, torch.device(device).type))
        return "eager"

    def refuse(*args, **kwargs):
        raise AssertionError("a fused kernel ran although the backend rule said eager")
    monkeypatch.setattr(dispatch, "backend", decide)
    monkeypatch.setattr(op, "route_unchecked", refuse)
    monkeypatch.setattr(op, "route_buffer", refuse)  # the models' depth-buffer path
    monkeypatch.setattr(triton_grouped, "route_phase1", refuse)
    monkeypatch.setattr(triton_grouped, "phase1_buffer", refuse)
    monkeypatch.setattr(triton_merge, "merge", refuse)
    monkeypatch.setattr(triton_merge, "merge_buffer", refuse)
    return asked


def test_the_rule(monkeypatch):
    """eager / compile as named; auto is triton on CUDA only; triton wherever the kernels can run."""
    assert dispatch.KERNELS == ROUTING_KERNELS  # the config's choices are the dispatcher's
    monkeypatch.setattr(op, "can_run", lambda device, dim, heads: dim == 32)
    assert [dispatch.backend(k, "cuda", 32, 2) for k in ROUTING_KERNELS] == ["eager", "compile", "triton", "triton"]
    assert [dispatch.backend(k, "cpu", 32, 2) for k in ROUTING_KERNELS] == ["eager", "compile", "triton", "eager"]
    assert dispatch.backend("triton", "cuda", 64, 2) == "eager"  # the kernels cannot run: the reference
    with pytest.raises(ValueError, match="unknown routing kernel 'fast'"):
        dispatch.backend("fast", "cpu", 32, 2)


@pytest.mark.parametrize("group_size", [1, 3])
def test_model_takes_the_patched_choice(patched, group_size):
    args = ModelArgs(**SHAPE, residual="attn_res", routing_heads=2, routing_kernel="triton",
                     routing_group_size=group_size)
    model = Transformer(args)
    model.init_weights()
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert patched and set(patched) == {("triton", "cpu")}


def test_dry_run_takes_the_patched_choice(patched):
    """The memory model charges the eager path's saved keys for a Triton job on CUDA."""
    args = ModelArgs(**SHAPE, residual="attn_res", routing_heads=2, routing_kernel="triton")
    cfg = SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode="none"))
    eager = _activation_elements_per_token(dataclasses.replace(args, routing_kernel="eager"), cfg, "cpu")
    assert _activation_elements_per_token(args, cfg, "cuda") == eager
    assert patched == [("eager", "cpu"), ("triton", "cuda")]


def test_benchmarks_take_the_patched_choice(patched):
    sources, query, norm_weight = routing_harness.make_inputs(1, 4, 32, 4, torch.float32, torch.device("cpu"))
    routing_harness.one_call("triton", sources, query, norm_weight, 2)()
    routing_harness.one_grouped_step("triton", sources, query, norm_weight, 2, 2)()
    assert patched and set(patched) == {("triton", "cpu")}


def test_analysis_takes_the_patched_choice(patched, monkeypatch):
    """routing_entropy runs the model's forward (the patched rule) and reads the weights from the
    reference (`route_reference(return_weights=True)`), once per site."""
    args = ModelArgs(**SHAPE, residual="attn_res", routing_heads=2, routing_kernel="auto")
    model = Transformer(args)
    model.init_weights()
    weights_read, real = [], reference.route_reference
    monkeypatch.setattr(reference, "route_reference", lambda *a, **k: weights_read.append(k) or real(*a, **k))
    entropy = routing_entropy(model, torch.zeros(1, 4, dtype=torch.long))
    assert patched and set(patched) == {("auto", "cpu")}
    assert len(weights_read) == model.plan.n_sites and all(k["return_weights"] for k in weights_read)
    expected = sum(torch.log(torch.tensor(float(s.n_sources))).item() for s in model.plan.sites) / model.plan.n_sites
    assert entropy == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_grouped_calls_are_checked_by_the_dispatcher(kernel):
    """Phase 1 and the merge check their arguments in the dispatcher, as a per-call route does: a
    source of another shape, a query of the wrong width or no (B, T, d) source is a ValueError
    naming it, on the eager and the fused path."""
    gen = torch.Generator().manual_seed(0)
    sources = [(torch.randn(1, 3, 16, generator=gen) * 1).requires_grad_() for _ in range(3)]
    rows = torch.zeros(2, 16), torch.ones(2, 16)
    reads = ((True, True, True), (True, True, True))
    mixes = dispatch.phase1(*rows, reads, 2, 1e-6, kernel, *sources)
    assert len(mixes) == 5 and mixes[0].shape == (1, 3, 16)
    with pytest.raises(ValueError, match="source 1 is"):
        dispatch.phase1(*rows, reads, 2, 1e-6, kernel, sources[0], torch.randn(1, 4, 16), sources[2])
    with pytest.raises(ValueError, match="query must have shape"):
        dispatch.phase1(torch.zeros(2, 8), rows[1], reads, 2, 1e-6, kernel, *sources)
    state = mixes[0].to(sources[0].dtype), mixes[2], mixes[4][0]
    out = dispatch.merge(*state, torch.zeros(16), torch.ones(16), 2, 1e-6, torch.float32, kernel, *sources[1:])
    assert out.shape == (1, 3, 16)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        dispatch.merge(*state, torch.zeros(16), torch.ones(8), 2, 1e-6, torch.float32, kernel, *sources[1:])
    with pytest.raises(ValueError, match="source 1 is"):
        dispatch.merge(*state, torch.zeros(16), torch.ones(16), 2, 1e-6, torch.float32, kernel, sources[1],
                       torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="at least one"):
        dispatch.phase1(*rows, ((True,), (True,)), 2, 1e-6, kernel, torch.zeros(16))
