"""``training.cuda_graphs``: what composes with it and what is refused before anything is built
(on CPU, and with the settings a graph cannot capture), named in one line with exit code 2.

The capture itself needs a GPU: tests/test_cuda_graphs_gpu.py (the GPU suite's tests row) and
bench/gpu_suite.sh's ``graphs`` rows run it (losses bitwise against eager); the step it captures
is held capture-safe on CPU by tests/test_capture_safe.py.
Here, on CPU: the fast settings (fused routing kernels, per-block compile, document masking,
AC full, every FSDP reshard mode) pass the check when CUDA is reported available; the attention
context of a document-masked batch is built from the token tensor by device ops only (on the
meta device, where a host read of a value raises), and a trace of it taken on one batch replays
exactly on another (make_fx records the aten ops of one call, as a capture records the kernels:
a value computed on the host would be frozen into it, and a planted one is caught), as does a
trace of the whole micro-step (forward, loss, backward, AC); after one warm-up micro-batch the
trainer's compiled model (per-block compile, FSDP2, AC, document masking) runs from its cache
under the capture's no-recompile guard, and a recompile there stops with an error naming the guard."""
import pathlib
import sys
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import ROOT  # noqa: E402
from train_common import SAMPLE, debug_argv, debug_cfg  # noqa: E402

from mhar_titan.components.cuda_graphs import (RecompiledDuringCapture, capture_blockers,  # noqa: E402
                                               check_cuda_graphs, no_recompile)
from mhar_titan.config import ConfigError, load_config  # noqa: E402
from mhar_titan.dryrun import build_model_args  # noqa: E402
from mhar_titan.models import ModelArgs, Transformer  # noqa: E402
from mhar_titan.models.attention_mask import attend, dense_mask, document_ids, flex_block_mask  # noqa: E402
from mhar_titan.models.model import apply_rope  # noqa: E402
from mhar_titan.train import main  # noqa: E402

FAST = ("--training.cuda_graphs=true", "--model.routing_kernel=triton", "--compile.enable=true",
        "--model.attn_mask_type=block_causal", "--activation_checkpoint.mode=full")
"""Acceptance 2's job: graphs with the fused routing kernels, per-block compile and document masking."""
FAMILIES = {"per call": (), "grouped": ("--model.routing_group_size=2",),
            "grouped auto": ("--model.routing_group_size=auto",)}
EOS = 0


def test_off_by_default(tmp_path):
    cfg = debug_cfg(tmp_path, "off")
    assert cfg.training.cuda_graphs is False
    check_cuda_graphs(cfg, build_model_args(cfg), cuda_available=False)  # nothing to refuse


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("reshard", ["default", "always", "never"])
@pytest.mark.parametrize("extra", [(), ("--compile.components=[\"model\", \"loss\"]", "--model.rope_per_document=true"),
                                   ("--compile.components=[\"whole_model\"]", "--model.routing_kernel=auto")],
                         ids=["blocks", "blocks+loss+rope_per_document", "whole_model+auto"])
def test_the_fast_settings_pass_on_cuda_and_are_refused_on_cpu_only_for_the_device(tmp_path, family, reshard,
                                                                                     extra):
    cfg = debug_cfg(tmp_path, "fast", *FAST, *FAMILIES[family], f"--parallelism.fsdp_reshard_after_forward={reshard}",
                    *extra)
    args = build_model_args(cfg)
    assert args.routing_kernel in ("triton", "auto") and args.attn_mask_type == "block_causal"
    assert cfg.compile.enable and cfg.activation_checkpoint.mode == "full"
    assert capture_blockers(cfg, args) == []
    check_cuda_graphs(cfg, args, cuda_available=True)
    with pytest.raises(ConfigError) as refused:
        check_cuda_graphs(cfg, args, cuda_available=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("'training.cuda_graphs' = true needs a CUDA device"), message
    assert not any(key in message for key in ("compile", "routing_kernel", "attn_mask_type", "cannot capture"))


def test_the_paper_recipe_composes_with_graphs():
    """The 1b MHAR recipe (micro-batch 4, AC full, routing_kernel "auto", FSDP2) with graphs, per-block
    compile, the fused kernels and document masking, per call and grouped."""
    for grouping in ([], ["--model.routing_group_size=auto"]):
        cfg = load_config(ROOT / "train_configs" / "mhar_1b.toml", [*FAST, *grouping])
        assert cfg.training.local_batch_size == 4
        args = build_model_args(cfg)
        check_cuda_graphs(cfg, args, cuda_available=True)
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            check_cuda_graphs(cfg, args, cuda_available=False)


def test_the_compiled_routing_body_composes_with_graphs(tmp_path):
    """routing_kernel = "compile" (per call: grouped routing has no compiled body) is warmed up and
    captured as per-block compile is."""
    cfg = debug_cfg(tmp_path, "compiled", "--training.cuda_graphs=true", "--model.routing_kernel=compile")
    check_cuda_graphs(cfg, build_model_args(cfg), cuda_available=True)


@pytest.mark.parametrize("overrides", [(), FAST], ids=["plain", "fast"])
def test_cpu_run_is_refused_before_anything_is_built(tmp_path, capsys, overrides):
    code = main(debug_argv(tmp_path, "cpu", "--training.cuda_graphs=true", *overrides))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "training.cuda_graphs" in err[0] and "CUDA device" in err[0], err
    assert "cannot capture" not in err[0]
    assert not (tmp_path / "cpu" / "metrics.jsonl").exists()  # nothing was started


@pytest.mark.parametrize("overrides, key", [
    (("--debug.force_nonfinite_loss_steps=[2]",), "debug.force_nonfinite_loss_steps"),
    (("--activation_checkpoint.mode=full", "--activation_checkpoint.preserve_rng_state=true"),
     "activation_checkpoint.preserve_rng_state"),
    (("--activation_checkpoint.mode=selective", "--activation_checkpoint.preserve_rng_state=true"),
     "activation_checkpoint.preserve_rng_state"),
])
def test_settings_that_cannot_be_captured_are_named(tmp_path, overrides, key):
    cfg = debug_cfg(tmp_path, "blocked", *FAST, *overrides)
    args = build_model_args(cfg)
    blockers = capture_blockers(cfg, args)
    assert len(blockers) == 1 and blockers[0].startswith(key), blockers
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as refused:
        check_cuda_graphs(cfg, args, cuda_available=True)
    assert "\n" not in str(refused.value)


def test_rng_state_without_checkpointing_is_no_blocker(tmp_path):
    cfg = debug_cfg(tmp_path, "rng", "--training.cuda_graphs=true", "--activation_checkpoint.mode=none",
                    "--activation_checkpoint.preserve_rng_state=true")
    assert capture_blockers(cfg, build_model_args(cfg)) == []


def test_dry_run_takes_the_fast_job_and_names_a_blocker(tmp_path, capsys):
    from mhar_titan.dryrun import main as dry_main

    assert dry_main(debug_argv(tmp_path, "fast", *FAST)) == 0  # the dry run checks a CUDA job by default
    assert "invalid job" not in capsys.readouterr().err
    code = dry_main(debug_argv(tmp_path, "dry", *FAST, "--debug.force_nonfinite_loss_steps=[2]"))
    assert code == 2  # the dry run's exit code for an invalid job, as train.py's
    err = capsys.readouterr().err
    assert "invalid job" in err and "training.cuda_graphs" in err and "debug.force_nonfinite_loss_steps" in err


# ------------------------------------------------------------------ the attention context under capture

def packed_batch(seed: int, B: int = 2, T: int = 150) -> torch.Tensor:
    """(B, T) tokens in [1, 10) with EOS at random places (documents differ per seed and row)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 10, (B, T), generator=g)
    tokens[torch.rand(B, T, generator=g) < 0.05] = EOS
    return tokens


def masked_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=16,
                                  max_seq_len=256, eos_id=EOS, attn_mask_type="block_causal",
                                  rope_per_document=True))
    model.init_weights()
    return model


class _Operands(TorchDispatchMode):
    """Every aten op's tensor operands' devices (0-dim wrapped Python numbers aside)."""

    def __init__(self):
        super().__init__()
        self.devices, self.ops = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in [*args, *kwargs.values()]:
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor):
                    self.devices.add(t.device.type)
        self.ops += 1
        return func(*args, **kwargs)


def test_the_document_context_is_built_on_the_device_from_the_tokens():
    """On the meta device a tensor has no values: reading one on the host (``.item()``, ``bool()``,
    ``.tolist()``) or an op whose output shape depends on values (``nonzero``) raises there. The
    attention context of a block_causal batch with per-document RoPE, and FlexAttention's block
    mask of its documents, build on it, and no host tensor is an operand (a table made on the host
    and copied in would be)."""
    model = masked_model().to("meta")
    tokens = torch.empty(2, 150, dtype=torch.long, device="meta")
    with _Operands() as ops:
        context = model.attention_context(tokens)  # the dense mask off CUDA
        block = flex_block_mask(document_ids(tokens, EOS))  # the CUDA path's BlockMask
    assert ops.ops > 20 and ops.devices == {"meta"}, ops.devices
    assert context.mask.shape == (2, 1, 150, 150) and context.cos.shape == (2, 1, 150, model.args.head_dim)
    assert block.kv_num_blocks.device.type == "meta" and block.kv_indices.shape == (2, 1, 2, 2)
    with pytest.raises(Exception):  # the premise: the same code with a host read does not build on meta
        document_ids(tokens, EOS).max().item()


def _context_attention(model: Transformer):
    """One attention sublayer's forward over the context of `tokens`: RoPE tables per document and
    the document mask, both built from `tokens` (the model's own `attention_context`)."""
    attention = model.layers[0].attention

    def run(tokens, x):
        return attention(x, model.attention_context(tokens))
    return run


def _flex_attention(tokens, q, k, v):
    """The CUDA path's mask: a FlexAttention BlockMask whose mask function closes over the document
    ids, run by FlexAttention's eager reference (the CPU has no compiled FlexAttention backward)."""
    return attend(q, k, v, flex_block_mask(document_ids(tokens, EOS)), compiled_flex=False)


def _host_built_flex_attention(tokens, q, k, v):
    """A planted fault: document ids computed on the host from the token values and copied in."""
    rows = [[sum(t == EOS for t in row[:i]) for i in range(len(row))] for row in tokens.tolist()]
    return attend(q, k, v, flex_block_mask(torch.tensor(rows)), compiled_flex=False)


@pytest.mark.parametrize("path", ["model context (dense mask, RoPE per document)", "flex block mask"])
def test_a_context_captured_on_one_batch_replays_on_another(path):
    """The stand-in for capture and replay on CPU: make_fx records the aten ops one call runs on real
    tensors (anything the host computed from the batch's values is frozen into the trace as a constant,
    as it would be into a CUDA graph). Traced on batch A, the trace run on batch B (other documents)
    equals a fresh eager call on B bitwise, and differs from A's output (the documents matter)."""
    g = torch.Generator().manual_seed(1)
    a, b = packed_batch(1), packed_batch(2)
    assert not torch.equal(document_ids(a, EOS), document_ids(b, EOS))
    if path.startswith("model"):
        fn, inputs = _context_attention(masked_model()), (torch.randn(2, 150, 32, generator=g),)
    else:
        fn, inputs = _flex_attention, tuple(torch.randn(2, n, 150, 8, generator=g) for n in (4, 2, 2))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # FlexAttention's eager reference warns that it is slow
        replay = make_fx(fn)(a, *inputs)
        fresh_b, replayed_b = fn(b, *inputs), replay(b, *inputs)
        assert torch.equal(replayed_b, fresh_b)
        assert not torch.allclose(fresh_b, fn(a, *inputs))


def test_a_host_built_context_is_caught_by_the_replay():
    """The replay check is not blind: ids made on the host from the token values replay A's documents."""
    g = torch.Generator().manual_seed(1)
    a, b = packed_batch(1), packed_batch(2)
    q, k, v = (torch.randn(2, n, 150, 8, generator=g) for n in (4, 2, 2))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(_host_built_flex_attention(b, q, k, v), _flex_attention(b, q, k, v))
        replay = make_fx(_host_built_flex_attention)(a, q, k, v)
        assert not torch.allclose(replay(b, q, k, v), _flex_attention(b, q, k, v))


@pytest.mark.parametrize("group, ac", [(1, "none"), (2, "full")], ids=["per call, AC none", "grouped, AC full"])
def test_a_whole_micro_step_captured_on_one_batch_replays_on_another(group, ac):
    """The micro-step a graph captures, forward (document mask, RoPE per document, depth routing,
    the loss) and backward (with AC full: the recomputation), traced by make_fx on batch A and run on
    batch B gives B's loss and every gradient bitwise. Routing on the eager path: make_fx cannot see
    into a Triton launch (the fused kernels' capture safety is tests/test_capture_safe.py's)."""
    from types import SimpleNamespace

    from mhar_titan.parallel import apply_ac

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                  max_seq_len=128, eos_id=EOS, attn_mask_type="block_causal", rope_per_document=True,
                                  residual="attn_res", routing_heads=4, routing_group_size=group,
                                  routing_kernel="eager"))
    model.init_weights()
    model.check_token_ids = False  # as the trainer: ids are checked on the host before the copy
    with torch.no_grad():
        model.routing.query.normal_()  # routing far from uniform
    assert apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="2", preserve_rng_state=False)) == \
        (2 if ac == "full" else 0)
    params = list(model.parameters())

    def step(x, y):
        loss = model(x, y)
        return (loss, *torch.autograd.grad(loss, params))

    (xa, ya), (xb, yb) = ((t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in (packed_batch(3, T=65),
                                                                                      packed_batch(4, T=65)))
    replay = make_fx(step)(xa, ya)
    got, want = replay(xb, yb), step(xb, yb)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(want[0], step(xa, ya)[0])


# ------------------------------------------------------------------ compiled code under capture

def test_a_recompile_during_capture_stops_with_the_guard_named():
    """Warmed-up compiled code runs from its cache inside ``no_recompile`` (the capture's context);
    a call that would recompile raises RecompiledDuringCapture naming training.cuda_graphs and the
    failed guard; other errors pass unchanged."""
    graphs = []

    def backend(gm, example_inputs):  # a compile is a call of the backend
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: x * 2 + 1, backend=backend)
    compiled(torch.ones(3))
    assert len(graphs) == 1
    with no_recompile():
        assert torch.equal(compiled(torch.zeros(3)), torch.ones(3))
    assert len(graphs) == 1  # served from the cache
    with pytest.raises(RecompiledDuringCapture) as err, no_recompile():
        compiled(torch.ones(3, 4))
    assert "training.cuda_graphs" in str(err.value) and "mismatch" in str(err.value), str(err.value)
    with pytest.raises(RuntimeError, match="^other$"), no_recompile():
        raise RuntimeError("other")
    compiled(torch.ones(3, 4))  # outside the context it compiles as usual
    assert len(graphs) == 2


@pytest.mark.skipif(not SAMPLE.exists(),
                    reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
@pytest.mark.slow  # per-block and loss torch.compile of the debug model, a Trainer per family
@pytest.mark.parametrize("family", ["per call", "grouped"])
def test_one_warm_up_micro_batch_compiles_everything_the_capture_runs(tmp_path, family, one_thread):
    """The trainer's model as built for a graphed job (per-block compile and the compiled loss, AC full,
    FSDP2, document masking with RoPE per document; aot_eager, so that CPU compiles in seconds: the
    guards are dynamo's whatever the backend): after one forward and backward, the next micro-batches
    of the same shape run from the cache inside ``no_recompile`` (the capture's context), and a batch
    of another shape is named there instead of compiled."""
    from mhar_titan.train import Trainer

    cfg = debug_cfg(tmp_path, "warm", "--compile.enable=true", "--compile.backend=aot_eager",
                    "--compile.components=[\"model\", \"loss\"]", "--model.attn_mask_type=block_causal",
                    "--model.rope_per_document=true", "--activation_checkpoint.mode=full",
                    "--training.local_batch_size=2", *FAMILIES[family])
    trainer = Trainer(cfg)
    try:
        g = torch.Generator().manual_seed(0)

        def micro_step(T=32):
            tokens = torch.randint(1, trainer.model_args.vocab_size, (2, T + 1), generator=g)
            tokens[torch.rand(2, T + 1, generator=g) < 0.1] = trainer.model_args.eos_id
            trainer.model(tokens[:, :-1], tokens[:, 1:], loss_fn=trainer.loss_fn).backward()

        micro_step()  # the warm-up
        with no_recompile():
            micro_step()
            micro_step()
        with pytest.raises(RecompiledDuringCapture, match="training.cuda_graphs"), no_recompile():
            micro_step(T=16)
    finally:
        trainer.close()

