"""AdamW parameter groups, LR schedules, per-group gradient norms and clipping."""
import math

import pytest
import torch
from helpers import ROOT, tiny_model

from mhar_titan.config import LRScheduler, Optimizer
from mhar_titan.optim import (
    WarmupStableDecay,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_by_group,
    param_group_of,
)


def lrs(cfg, steps, run=None):
    """The LR of each of the first `run` (default all) steps of a `steps`-step schedule, and the scheduler."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_lr_scheduler(opt, cfg, steps)
    out = []
    for _ in range(steps if run is None else run):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, sched


def test_warmup_cosine_to_floor_matches_closed_form():
    cfg = LRScheduler(warmup_steps=4, decay_type="cosine", min_lr_factor=0.1)
    got, _ = lrs(cfg, 20)
    peak = 2.0
    assert got[:4] == pytest.approx([peak * s / 4 for s in (1, 2, 3, 4)])
    for s in range(5, 21):
        p = (s - 4) / 16
        assert got[s - 1] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))))
    assert got[-1] == pytest.approx(0.2)  # the floor at the last step


def test_wsd_has_stable_phase_then_linear_decay():
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.0)
    got, _ = lrs(cfg, 20)
    assert got[:2] == pytest.approx([1.0, 2.0])
    assert got[2:15] == pytest.approx([2.0] * 13)  # stable until step 15 = 20 - 5
    assert got[15:] == pytest.approx([2.0 * (1 - k / 5) for k in range(1, 6)])
    sqrt = WarmupStableDecay(20, 2, 0.25, "sqrt", 0.0)
    assert sqrt.factor(16) == pytest.approx(1 - math.sqrt(0.2))


def test_scheduler_state_round_trip_resumes_schedule():
    cfg = LRScheduler(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1)
    full, _ = lrs(cfg, 12)
    p = torch.nn.Parameter(torch.zeros(1))
    _, sched = lrs(cfg, 12, run=5)
    state = sched.state_dict()
    opt2 = torch.optim.AdamW([p], lr=2.0)
    sched2 = build_lr_scheduler(opt2, cfg, 12)
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(full[5])



def test_resume_with_more_steps_follows_the_new_schedule_and_warns(caplog):
    cfg = LRScheduler(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1)
    p = torch.nn.Parameter(torch.zeros(1))
    _, sched = lrs(cfg, 12, run=5)
    state = sched.state_dict()
    longer = build_lr_scheduler(torch.optim.AdamW([p], lr=2.0), cfg, 24)
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        longer.load_state_dict(state)
    assert "LR schedule differs" in caplog.text and "'steps': 12" in caplog.text
    assert longer.last_epoch == 5
    assert longer.lr_lambdas[0].steps == 24  # the config's schedule, not the checkpoint's
    longer_full, _ = lrs(cfg, 24)
    assert longer.get_last_lr()[0] == pytest.approx(longer_full[5])
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(longer_full[5])
    same = build_lr_scheduler(torch.optim.AdamW([p], lr=2.0), cfg, 12)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        same.load_state_dict(state)
    assert caplog.text == ""

@pytest.mark.parametrize("warmup, steps, end", [(20, 10, 0.5), (10, 10, 1.0)])
def test_warmup_as_long_as_the_run_warns_and_ends_inside_the_warmup(caplog, warmup, steps, end):
    """Documented behaviour (WarmupStableDecay): the warm-up is kept, so the run ends at
    steps / warmup of the peak and the warning names both keys and that end value."""
    cfg = LRScheduler(warmup_steps=warmup, decay_type="cosine", min_lr_factor=0.1)
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        got, _ = lrs(cfg, steps)
    assert got == pytest.approx([2.0 * s / warmup for s in range(1, steps + 1)])
    assert got[-1] == pytest.approx(2.0 * end)
    assert (f"lr_scheduler.warmup_steps = {warmup} >= training.steps = {steps}" in caplog.text
            and f"ends at {end:.3g} x the peak LR, not at min_lr_factor = 0.1" in caplog.text)
    longer, _ = lrs(cfg, 2 * warmup)  # the first steps do not depend on training.steps
    assert longer[:steps] == pytest.approx(got)


def test_warmup_shorter_than_the_run_does_not_warn_and_ends_at_the_floor(caplog):
    cfg = LRScheduler(warmup_steps=5, decay_type="linear", min_lr_factor=0.1)
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        got, _ = lrs(cfg, 10)
    assert caplog.text == "" and got[-1] == pytest.approx(0.2)


@pytest.mark.parametrize("warmup, ratio, steps, asked, got", [
    (8, 0.5, 10, 5, 2),     # WSD: the warm-up ends after the decay should have started
    (9, None, 10, 1, 1),    # warm-up then decay: the whole decay in one step
    (60, 0.5, 100, 50, 40),
])
def test_a_decay_cut_short_warns_in_the_trainer_and_the_dry_run(caplog, warmup, ratio, steps, asked, got):
    from mhar_titan.dryrun import validate_job, build_model_args
    from mhar_titan.config import load_config
    from mhar_titan.optim import decay_steps

    cfg = LRScheduler(warmup_steps=warmup, decay_ratio=ratio, decay_type="linear", min_lr_factor=0.1)
    assert decay_steps(cfg, steps)[1] == asked
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        lr, _ = lrs(cfg, steps)
    # the schedule itself: peak at the end of the warm-up, then `got` decay steps to the floor
    assert lr[warmup - 1] == pytest.approx(2.0) and lr[-1] == pytest.approx(0.2)
    assert sum(1 for x in lr[warmup:] if x < 2.0 - 1e-12) == got
    assert f"gets {got} step" in caplog.text or f"leaves the decay {got} step" in caplog.text
    job = load_config(str(ROOT / "train_configs" / "debug_mhar.toml"), ["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup),
                             *(["--lr_scheduler.decay_ratio", str(ratio)] if ratio is not None else [])])
    warnings = validate_job(job, build_model_args(job), 1)
    assert any(f"{got} step" in w and "lr_scheduler.warmup_steps" in w for w in warnings)


def test_wsd_without_overlap_decays_over_the_ratio_silently(caplog):
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0)
    with caplog.at_level("WARNING", logger="mhar_titan.optim"):
        lr, _ = lrs(cfg, 10)
    assert caplog.text == ""
    assert lr[:5] == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0])  # decay_start = 10 - round(0.5 * 10) = 5
    assert lr[5:] == pytest.approx([2.0 * (1 - k / 5) for k in range(1, 6)])


def test_param_groups_and_no_decay():
    model = tiny_model(vocab_size=64, max_seq_len=16, residual="attn_res", routing_heads=2)
    groups = param_group_of(model)
    assert groups["routing.query"] == groups["routing.key_norm"] == "routing"
    assert groups["tok_embeddings.weight"] == "embeddings"
    assert groups["norm.weight"] == groups["layers.0.attention_norm.weight"] == "norms"
    assert groups["layers.0.attention.q_norm.weight"] == "norms"
    assert groups["layers.1.feed_forward.w1.weight"] == "other"

    opt = build_optimizer(model, Optimizer(lr=1e-3, weight_decay=0.1, no_decay=["norms", "routing"]))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert "routing.query" in nd and "norm.weight" in nd and "tok_embeddings.weight" not in nd
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["betas"] == (0.9, 0.95)

    # the paper decays everything: a single group
    assert len(build_optimizer(model, Optimizer()).param_groups) == 1


@pytest.mark.parametrize("residual", ["dense", "mudd"])
def test_connection_parameters_are_routing_and_never_muon(residual):
    """DenseFormer's and MUDDFormer's parameters are the ``routing`` group; DenseFormer's weights
    are decayed as the job says (its reference decays them), MUDDFormer's never (its module says
    ``weight_decay = False``), whatever ``optimizer.no_decay`` lists; Muon orthogonalises none of
    them; MUDDFormer's K and V stream norms, inside the blocks, are norms; their gradients are
    logged as ``rest`` (no query or gate of depth routing)."""
    from mhar_titan.optim.build import optimizer_split

    model = tiny_model(vocab_size=64, max_seq_len=16, residual=residual)
    groups = param_group_of(model)
    connection = {n for n in groups if n.startswith("routing.")}
    assert connection and {groups[n] for n in connection} == {"routing"}
    if residual == "mudd":
        assert groups["layers.1.attention_norm.k.weight"] == groups["layers.1.attention_norm.v.weight"] == "norms"
    names = {id(p): n for n, p in model.named_parameters()}
    for cfg in (Optimizer(weight_decay=0.1), Optimizer(name="Muon", weight_decay=0.1, muon_groups=["other"])):
        opt = build_optimizer(model, cfg)
        by_name = {names[id(p)]: g["weight_decay"] for o in getattr(opt, "optimizers", [opt]) for g in o.param_groups
                   for p in g["params"]}
        assert {by_name[n] for n in connection} == ({0.1} if residual == "dense" else {0.0}), cfg.name
        assert by_name["layers.0.feed_forward.w1.weight"] == 0.1
        assert not connection & {n for n, _ in optimizer_split(model, cfg)["Muon"]}
    model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    _, norms = clip_grad_norm_by_group(model, max_norm=0.0)
    assert set(norms) == {"rest"}


def test_group_grad_norms_and_clipping_match_torch():
    model = tiny_model(vocab_size=64, max_seq_len=16, residual="attn_res", routing_heads=2, routing_mode="delta")
    ref = tiny_model(vocab_size=64, max_seq_len=16, residual="attn_res", routing_heads=2, routing_mode="delta")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (model, ref):
        m.routing.query.data.normal_(generator=torch.Generator().manual_seed(1))
        m.routing.alpha.data.fill_(0.5)
        m(tokens).float().pow(2).mean().backward()
    q, a = model.routing.query.grad.norm(), model.routing.alpha.grad.norm()
    assert q > 0 and a > 0
    total, norms = clip_grad_norm_by_group(model, max_norm=0.01)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert total.item() == pytest.approx(ref_total.item(), rel=1e-5)
    assert norms["routing_query"].item() == pytest.approx(q.item(), rel=1e-5)
    assert norms["routing_gate"].item() == pytest.approx(a.item(), rel=1e-5)
    assert sum(n.item() ** 2 for n in norms.values()) == pytest.approx(total.item() ** 2, rel=1e-5)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-9)


def test_nonfinite_gradients_are_reported_not_scaled():
    model = tiny_model(vocab_size=64, max_seq_len=16)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.norm.weight.grad[0] = float("nan")
    total, _ = clip_grad_norm_by_group(model, max_norm=1.0)
    assert not torch.isfinite(total)
    assert model.layers[0].attention.wq.weight.grad.eq(1).all()  # left untouched
