"""Muon with AdamW (``optimizer.name = "Muon"``): the split, torch.optim.Muon's arithmetic in one
process, FSDP2 on 2 and 3 gloo ranks against a single-process torch.optim.Muon + AdamW run, and
the settings the config refuses."""
import copy
import itertools
import math
import sys

import pytest
import torch
import torch.optim._muon as torch_muon
from helpers import ROOT, tiny_model
from train_common import debug_cfg

from mhar_titan.components.loss import build_loss_fn, target_count
from mhar_titan.config import Optimizer, load_config
from mhar_titan.dryrun import build_meta_model, build_model_args, report
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer
from mhar_titan.optim import (MuonWithAdamW, WarmupStableDecay, build_optimizer, muon_comm_bytes, newton_schulz,
                              optimizer_split, param_group_of)

pytestmark = pytest.mark.usefixtures("one_thread")
DEBUG_MHAR = ROOT / "train_configs" / "debug_mhar.toml"


def torch_pair(model, names, o: Optimizer):
    """torch.optim.Muon over the named matrices and torch.optim.AdamW over the rest, with ``o``'s settings."""
    muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in names], lr=o.muon_lr or o.lr,
                            weight_decay=o.weight_decay, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                            ns_coefficients=tuple(o.muon_ns_coefficients), eps=o.muon_eps, ns_steps=o.muon_ns_steps,
                            adjust_lr_fn=o.muon_lr_scale)
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in names], lr=o.lr,
                              betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    return muon, adamw


@pytest.mark.parametrize("settings", [
    dict(),
    dict(muon_lr_scale="original", muon_nesterov=False, muon_momentum=0.9, muon_lr=0.02, muon_ns_steps=3),
])
def test_one_process_is_bitwise_torch_muon_and_adamw(settings):
    model = tiny_model(vocab_size=64, max_seq_len=16, residual="attn_res", routing_heads=2, tie_embeddings=False)
    ref = copy.deepcopy(model)
    o = Optimizer(name="Muon", lr=1e-2, muon_ns_dtype="bfloat16", **settings)
    opt = build_optimizer(model, o)
    assert isinstance(opt, MuonWithAdamW)
    names = {n for n, _ in optimizer_split(model, o)["Muon"]}
    ref_opts = torch_pair(ref, names, o)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        for m in (model, ref):
            m(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for r in ref_opts:
            r.step()
            r.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    moved = [n for n, p in model.named_parameters() if n in names]
    assert moved and all("momentum_buffer" in opt.state[p] for n, p in model.named_parameters() if n in names)
    assert all("exp_avg" in opt.state[p] for n, p in model.named_parameters() if n not in names)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
def test_newton_schulz_in_fp32_is_torchs_iteration_at_fp32_precision(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    coefficients = tuple(Optimizer().muon_ns_coefficients)
    ours = newton_schulz(g, coefficients, 5, 1e-7, torch.float32)
    theirs = torch_muon._zeropower_via_newtonschulz(g, coefficients, 5, 1e-7).float()
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    assert torch.equal(newton_schulz(g, coefficients, 5, 1e-7, torch.bfloat16), torch_muon._zeropower_via_newtonschulz(
        g, coefficients, 5, 1e-7))
    assert (ours - theirs).norm() / theirs.norm() < 2e-2  # bf16 rounding only
    # the same iteration in float64 (written out here) agrees to fp32 rounding
    a, b, c = coefficients
    x = g.double().T if shape[0] > shape[1] else g.double()
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if shape[0] > shape[1] else x
    assert (ours.double() - x).abs().max() < 1e-5
    s = torch.linalg.svdvals(ours)
    assert s.min() > 0.5 and s.max() < 1.5  # orthogonalised: every singular value near 1


FAMILIES = {
    "baseline": dict(residual="standard"),
    "attnres": dict(residual="attn_res", routing_heads=1),
    "mhar": dict(residual="attn_res", routing_heads=4),
}


@pytest.mark.parametrize("family, granularity, mode, null, tied", [
    (f, g, m, n, t) for f, g, m, n, t in itertools.product(FAMILIES, ("sublayer", "block"), ("replace", "delta"),
                                                              (False, True), (True, False))
    if f != "baseline" or (g, m, n) == ("sublayer", "replace", False)
])
def test_every_parameter_is_in_exactly_one_optimizer_and_routing_is_never_orthogonalised(
        family, granularity, mode, null, tied):
    fields = dict(FAMILIES[family], tie_embeddings=tied)
    if family != "baseline":
        fields.update(routing_granularity=granularity, routing_mode=mode, routing_null_source=null,
                      **(dict(routing_block_layers=1) if granularity == "block" else {}))
    with torch.device("meta"):
        model = tiny_model(vocab_size=64, max_seq_len=16, **fields)
    groups = param_group_of(model)
    for muon_groups in (["other"], ["other", "head", "embeddings"]):
        o = Optimizer(name="Muon", muon_groups=muon_groups)
        opt = build_optimizer(model, o)
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each exactly once
        muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
        names = {n for n, p in model.named_parameters() if id(p) in muon_ids}
        assert names == {n for n, _ in optimizer_split(model, o)["Muon"]}
        assert not any(groups[n] == "routing" for n in names)
        assert all(p.ndim == 2 and groups[n] in muon_groups for n, p in model.named_parameters() if n in names)
        # every hidden matrix of every block is Muon's
        assert {n for n in groups if groups[n] == "other"} <= names
    if family != "baseline":
        assert any(groups[n] == "routing" and p.ndim == 2 for n, p in model.named_parameters())


def test_dry_run_prints_the_split_and_the_communication():
    cfg = load_config(str(ROOT / "train_configs" / "mhar_1b.toml"), ["--optimizer.name=Muon"])
    text, _ = report(cfg, 8, "cuda")
    model = build_meta_model(build_model_args(cfg))
    split = optimizer_split(model, cfg.optimizer)
    numel = sum(math.prod(s) for _, s in split["Muon"])
    assert f"Muon: {len(split['Muon'])} tensors, {numel:,} parameters" in text
    assert "layers.*.feed_forward.w2.weight" in text and "routing.query" in text.split("AdamW:")[1]
    comm = muon_comm_bytes([s for _, s in split["Muon"]], 8, "bfloat16")
    assert comm == numel * 7 * 2 // 8
    assert f"{comm / 2**20:,.1f} MiB received per rank per step on 8 FSDP ranks" in text


# --------------------------------------------------------------------------- FSDP2


def _ns64(g, coefficients, steps, eps):
    """The Newton-Schulz iteration in float64 (independent of mhar_titan.optim), for the reference."""
    a, b, c = coefficients
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if g.size(0) > g.size(1) else x).float()


def single_process_reference(record: dict, cfg):
    """The recorded steps in one process without FSDP: torch.optim.Muon on the Muon matrices, torch.optim.AdamW
    on the rest, the same clipping and schedule. Returns (losses, {name: final weight})."""
    model = Transformer(ModelArgs(**record["args"]))
    model.load_state_dict(record["initial"])
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    names = {n for n, _ in optimizer_split(model, o)["Muon"]}
    opts = torch_pair(model, names, o)
    scheds = [torch.optim.lr_scheduler.LambdaLR(op, WarmupStableDecay(
        t.steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor)) for op in opts]
    loss_fn = build_loss_fn(cfg.compile, t.z_loss, t.loss_path, t.loss_chunk_tokens)
    losses = []
    for micro in record["batches"]:
        n = sum(target_count(y) for _, y in micro).float()
        total = 0.0
        for x, y in micro:
            loss = model(x, y, loss_fn=loss_fn)
            (loss / n).backward()
            total += loss.item()
        losses.append(total / n.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        for op in opts:
            op.step()
            op.zero_grad()
        for sc in scheds:
            sc.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


# lr 1e-3 (the debug config has 3e-3): AdamW normalises every element, so the float rounding of
# near-zero gradient elements (another summation order on several ranks) becomes an update
# difference of up to ~lr per step; AdamW alone (no Muon) at 3e-3 differs from one process by 2.2e-5
# after 5 steps, at 1e-3 by under 3e-6 (measured 2026-12-01). Muon's matrices differ by < 3e-7.
MUON_RUN = ["--optimizer.name=Muon", "--optimizer.muon_ns_dtype=float32", "--optimizer.lr=1e-3", "--training.steps=5"]


# about 40 s per world size on 2 idle cores (torchrun start-up, 5 steps)
@pytest.mark.parametrize("world, geometry", [
    (2, ["--training.local_batch_size=2", "--training.global_batch_size=4"]),
    # 128 and 64 rows over 3 ranks: uneven shards; gradient accumulation 2, activation checkpointing and a
    # weight EMA beside the optimizer (not z-loss: its gradient reaches every row of the tied embedding,
    # and AdamW turns the rounding of those tiny gradients into 1.9e-5 after 5 steps, measured; Muon's
    # matrices then differ by 1e-8)
    (3, ["--training.local_batch_size=1", "--training.global_batch_size=6", "--activation_checkpoint.mode=full",
         "--training.ema_decay=0.9"]),
])
def test_fsdp_ranks_equal_one_process_torch_muon_and_adamw(tmp_path, monkeypatch, torchrun, world, geometry):
    """FSDP2 over `world` gloo ranks against one process applying torch.optim.Muon (its Newton-Schulz
    iteration in float64, the fp32 run's reference) and torch.optim.AdamW to the same parameters with
    the same settings, clipping and schedule. fp32 arithmetic: bf16 Newton-Schulz rounds the update to
    bf16, so the trajectories of an FSDP and a one-process run part at bf16 precision (one process
    against torch.optim.Muon in bf16 is bitwise: test_one_process_is_bitwise_torch_muon_and_adamw)."""
    name = f"w{world}"
    overrides = [*MUON_RUN, *geometry]
    done = torchrun(ROOT / "tests" / "muon_fsdp_worker.py", tmp_path, name, *overrides, nproc=world)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"| optimizer | Muon 28 matrices, 786k params | AdamW 20 tensors, 6.44M params" in done.stdout
    record = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    assert record["grad_accum"] == (2 if world == 3 else 1)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns64)
    losses, final = single_process_reference(record, debug_cfg(tmp_path, "ref", *overrides))
    assert record["losses"] == pytest.approx(losses, rel=1e-6)
    worst = {n: (final[n] - record["final"][n]).abs().max().item() for n in final}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    moved = {n: (record["final"][n] - record["initial"][n]).abs().max().item() for n in final}
    assert min(v for n, v in moved.items() if "wq" in n) > 1e-4  # the matrices did train


# --------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("override, needle", [
    ("--optimizer.muon_ns_steps=0", "'optimizer.muon_ns_steps' must be 1 to 99"),
    ("--optimizer.muon_ns_steps=-2", "'optimizer.muon_ns_steps' must be 1 to 99"),
    ("--optimizer.muon_ns_coefficients=[nan, -4.775, 2.0315]", "'optimizer.muon_ns_coefficients[0]' must be a finite"),
    ("--optimizer.muon_ns_coefficients=[3.4445, inf, 2.0315]", "'optimizer.muon_ns_coefficients[1]' must be a finite"),
    ("--optimizer.muon_ns_coefficients=[3.4445, -4.775]", "'optimizer.muon_ns_coefficients' must be three finite"),
    ("--optimizer.muon_eps=0", "'optimizer.muon_eps' must be a finite number > 0"),
    ("--optimizer.muon_eps=inf", "'optimizer.muon_eps' must be a finite number"),
    ("--optimizer.muon_lr=-1e-3", "'optimizer.muon_lr' must be a finite number > 0"),
    ("--optimizer.muon_lr=nan", "'optimizer.muon_lr' must be a finite number"),
    ("--optimizer.muon_momentum=1.0", "'optimizer.muon_momentum' must be in [0, 1)"),
    ("--optimizer.muon_groups=[\"mlp\"]", "'optimizer.muon_groups' has unknown or non-matrix groups ['mlp']"),
    ("--optimizer.muon_groups=[\"norms\"]", "'optimizer.muon_groups' has unknown or non-matrix groups ['norms']"),
    ("--optimizer.muon_groups=[\"routing\"]", "routing parameters (pseudo-queries, key norms, null sources, delta "
                                             "gates) are never orthogonalised"),
    ("--optimizer.muon_ns_dtype=float16", "'optimizer.muon_ns_dtype' = 'float16' is not one of"),
    ("--optimizer.muon_lr_scale=plain", "'optimizer.muon_lr_scale' = 'plain' is not one of"),
])
def test_bad_muon_settings_exit_2_with_one_line_before_anything_is_built(tmp_path, capsys, override, needle):
    from mhar_titan.train import main

    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={tmp_path}", "--optimizer.name=Muon", override])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("config error: ") and needle in err and len(err.strip().splitlines()) == 1, err
    assert "| start |" not in out and not (tmp_path / "debug_mhar").exists()


def test_optimizer_bench_runs_at_toy_size(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import optimizer as bench

    assert bench.main(["--flavor", "debug", "--reps", "1", "--threads", "1", "--comm-flavor", "debug",
                       "--comm-world", "2"]) == 0
    out = capsys.readouterr().out
    assert "| AdamW (foreach) | 0 |" in out and "| Muon (float32 Newton-Schulz) + AdamW | 28 |" in out
    assert "| 1.0x |" in out
    shapes = [s for _, s in optimizer_split(build_meta_model(build_model_args(load_config(str(DEBUG_MHAR)))),
                                            Optimizer(name="Muon"))["Muon"]]
    assert f"{muon_comm_bytes(shapes, 2, 'bfloat16') / 2**30:.2f} GiB received per rank per step" in out


def test_muon_groups_without_a_matrix_in_this_model_is_a_config_error():
    from mhar_titan.errors import ConfigError

    model = tiny_model(vocab_size=64, max_seq_len=16, residual="attn_res", routing_heads=2)  # tied head
    with pytest.raises(ConfigError, match="no parameter of this model is a matrix of optimizer.muon_groups"):
        build_optimizer(model, Optimizer(name="Muon", muon_groups=["head"]))
