"""The depth connections' cost model (models/connections/base.py: `flops_per_token`, `depth_reads`,
`kept_rows`) against counts of the eager code, and where the framework reads it: the dry run's
parameter, FLOPs, bytes and memory lines, `metrics.flops_per_token` and the bytes model.

- depth reads: a dispatch-mode count of one bf16 training step (bench/byte_count.py,
  `depth_history_reads`: every aten op's reads of the flow's (B, T, d) history tensors, forward and
  backward) within 5% of `depth_reads`, at the CPU study's shape (12 x d64);
- kept rows: the (B, T, ...) storages still alive after an eager forward, beyond the baseline's,
  equal `kept_rows("none")` rounded up to rows, and under AC full what is alive before the backward
  starts is at most `kept_rows("full")` (which adds the block recomputed at a time);
- FLOPs: torch's FLOP counter (matmuls) within 2% of the closed form (tests/test_metrics.py);
- parameters: the dry run prints the issue's formulas (tests/test_depth_connections.py checks the
  closed form against the built model).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import pathlib
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhar_titan.components.performance import depth_read_bytes, routing_step_bytes, step_traffic
from mhar_titan.metrics import flops_per_token
from mhar_titan.models.args import FAMILIES, ModelArgs, connection_parameters, mudd_hidden, mudd_streams
from mhar_titan.models.connections import build_connection
from mhar_titan.models.connections.base import checkpointed_blocks
from mhar_titan.models.model import Transformer
from mhar_titan.parallel import apply_ac

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import byte_count  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STUDY = dict(dim=64, n_layers=12, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=384)
"""train_configs/study_bytes.toml's decoder (the CPU study)."""
HISTORY = lambda flow: [flow.buffer.values]  # noqa: E731
"""Where DenseFormer's and MUDDFormer's eager flows keep their depth history: one depth buffer."""


@pytest.mark.parametrize("family", ["dense", "mudd", "mudd_plain"])
def test_modelled_depth_reads_equal_a_count_of_the_eager_step(family):
    """Rows of the depth buffer read in one bf16 step, counted op by op, against `depth_reads`
    (within 5%, the issue's bound): every average of DenseFormer and every block's streams of
    MUDDFormer read their rows once forward and once backward (90 rows each way at 12 layers for
    DenseFormer, 89 for MUDDFormer); measured equal."""
    args = ModelArgs.from_flavor("debug", **FAMILIES[family], **STUDY)
    counted = byte_count.depth_history_reads(args, 2, 8, HISTORY)
    forward, backward = build_connection(args).depth_reads()
    assert abs(counted["forward"] / forward - 1) <= 0.05, (counted, forward)
    assert abs(counted["backward"] / backward - 1) <= 0.05, (counted, backward)
    assert (counted["forward"], counted["backward"]) == (forward, backward)


def test_depth_reads_follow_the_formulas():
    """DenseFormer at k = p = 1: L(L+3)/2 rows each way; MUDDFormer: sum_i (i+2), every stream of a
    block from one read of its rows; depth routing: the plan's routing rows (per call: N forward,
    N + 2 backward per site)."""
    L = 12
    dense = ModelArgs.from_flavor("debug", **FAMILIES["dense"], **STUDY)
    assert build_connection(dense).depth_reads() == (L * (L + 3) // 2,) * 2
    sparse = dataclasses.replace(dense, dense_dilation=2, dense_period=3)
    averages = [i for i in range(L) if (i + 1) % 3 == 0]
    assert build_connection(sparse).depth_reads() == (sum((i + 1) // 2 + 1 for i in averages),) * 2
    mudd = ModelArgs.from_flavor("debug", **FAMILIES["mudd"], **STUDY)
    rows = sum(i + 2 for i in range(L))
    assert build_connection(mudd).depth_reads() == (rows, rows)
    plain = dataclasses.replace(mudd, mudd_prepost_norm=False)
    assert build_connection(plain).depth_reads() == (rows, rows)
    mhar = ModelArgs.from_flavor("debug", **FAMILIES["mhar H=8"], **STUDY)
    S = 2 * L + 1
    assert build_connection(mhar).depth_reads() == (S * (S + 1) // 2, S * (S + 1) // 2 + 2 * S)
    assert build_connection(ModelArgs.from_flavor("debug", **STUDY)).depth_reads() == (0, 0)


def test_bytes_model_reads_the_connection():
    """`depth_read_bytes`: rows x tokens x d x 2 bytes (bf16), the forward's rows again under AC
    full (in proportion to the recomputed blocks under selective AC); `routing_step_bytes` is
    the depth reads for a connection without routing sites and depth routing's counted kernel
    traffic otherwise; 0 for the baseline."""
    tokens = 4 * 64
    for family in ("dense", "mudd", "mudd_plain"):
        args = ModelArgs.from_flavor("debug", **FAMILIES[family], **STUDY)
        forward, backward = build_connection(args).depth_reads()
        row = tokens * args.dim * 2
        assert depth_read_bytes(args, tokens) == (forward + backward) * row
        assert depth_read_bytes(args, tokens, "full") == (2 * forward + backward) * row
        # selective:3 recomputes blocks 3, 6, 9 and 12 of the 12
        assert depth_read_bytes(args, tokens, "selective:3") == round((forward * 4 / 3 + backward) * row)
        assert routing_step_bytes(args, tokens, "full") == depth_read_bytes(args, tokens, "full")
    mhar = ModelArgs.from_flavor("debug", **FAMILIES["mhar H=8"], **STUDY)
    assert routing_step_bytes(mhar, tokens) == step_traffic(mhar, tokens, torch.bfloat16).total
    assert routing_step_bytes(ModelArgs.from_flavor("debug", **STUDY), tokens) == 0


def test_flops_follow_the_formulas():
    """3 x the forward FLOPs of `Connection.flops_per_token` in `metrics.flops_per_token`'s routing
    part: DenseFormer 2 d per source of every average; MUDDFormer the generator's matmuls and the
    streams' weighted sums; depth routing 4 d per source of every site, as before."""
    dense = ModelArgs.from_flavor("debug", **FAMILIES["dense"], **STUDY)
    d, L = dense.dim, dense.n_layers
    assert flops_per_token(dense, 128).routing == 3 * 2 * d * (L * (L + 3) // 2)
    mudd = ModelArgs.from_flavor("debug", **FAMILIES["mudd"], **STUDY)
    expected = sum(2 * d * mudd_hidden(mudd, i) + 2 * mudd_hidden(mudd, i) * mudd_streams(mudd, i) * (i + 2)
                   + 2 * d * mudd_streams(mudd, i) * (i + 2) for i in range(L))
    assert flops_per_token(mudd, 128).routing == 3 * expected
    mhar = ModelArgs.from_flavor("debug", **FAMILIES["mhar H=8"], **STUDY)
    assert flops_per_token(mhar, 128).routing == 12 * d * sum(range(1, 2 * L + 2))


def alive_rows(args, ac: str, batch: int = 3, seq: int = 7) -> float:
    """Per-token elements alive after an fp32 forward (what the backward will read), in rows of d
    per token, less the logits: every storage an aten op made with a whole number of elements per
    token (numel a multiple of B T: activations, depth buffers, per-token weights), weakly
    referenced, that outlived the forward."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    made = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() and t.numel() % (batch * seq) == 0 and not func.is_view:
                    made.append(weakref.ref(t.untyped_storage()))
            return out

    with Made():
        logits = model(tokens)
    gc.collect()
    alive = {id(s): s.nbytes() // 4 for s in (ref() for ref in made) if s is not None}
    return (sum(alive.values()) - logits.numel()) / (batch * seq * args.dim)


@pytest.mark.parametrize("n_layers", [2, 5])
@pytest.mark.parametrize("family", ["dense", "mudd", "mudd_plain"])
def test_kept_rows_equal_what_the_eager_forward_keeps(family, n_layers):
    """Without checkpointing, the storages alive after the forward beyond the baseline's are
    `kept_rows("none")` rows, rounded up (DenseFormer: its depth buffer, L + 1 rows; MUDDFormer at
    2 layers, d = 128, with the pre/post DA norm: 27.16 rows measured); under AC full the part
    alive before the backward (the depth buffer and the input streams the checkpointed blocks hold)
    is at most `kept_rows("full")`, which adds the block recomputed at a time, and equals it less
    that block's rows (MUDDFormer: 4L - 1 rows with the pre/post DA norm, 4L - 2 without)."""
    shape = dict(STUDY, n_layers=n_layers, dim=128, n_heads=4)
    args = ModelArgs.from_flavor("debug", **FAMILIES[family], **shape)
    base = ModelArgs.from_flavor("debug", **shape)
    connection = build_connection(args)
    none = alive_rows(args, "none") - alive_rows(base, "none")
    assert math.ceil(none - 1e-9) == connection.kept_rows("none"), none
    full = alive_rows(args, "full") - alive_rows(base, "full")
    assert full <= connection.kept_rows("full") <= connection.kept_rows("none"), full
    if family == "dense":
        assert connection.kept_rows("full") == connection.kept_rows("none") == n_layers + 1 == full
    else:
        assert round(full) == 4 * n_layers - (1 if args.mudd_prepost_norm else 2), full


def test_checkpointed_blocks_follow_apply_ac():
    """'selective:k' checkpoints blocks k, 2k, ... (1-based), as parallel.apply_ac; other spellings
    are refused."""
    assert checkpointed_blocks("none", 3) == (False, False, False)
    assert checkpointed_blocks("full", 2) == (True, True)
    assert checkpointed_blocks("selective:2", 5) == (False, True, False, True, False)
    for bad in ("selective", "selective:0", "some"):
        with pytest.raises(ValueError, match="'none', 'full' or 'selective:k'"):
            checkpointed_blocks(bad, 3)


@pytest.mark.parametrize("family", ["dense", "mudd", "mudd_plain", "hyper", "hyper_static", "mhc", "mhc mean"])
def test_dry_run_prints_the_connection_costs(family, tmp_path):
    """The dry run's connection count is the issue's formula (DenseFormer L(L+3)/2; MUDDFormer
    sum_i d K_i + K_i C_i (i+2) + C_i (i+2) and its norms; Hyper-Connections 2L (n(n+2) + d(n+2) +
    2d + 2), static 2L n(n+2); mHC 2L ((n^2+2n) nd + n^2 + 2n + 3) + n nd + n + 1 with the learned
    exit), its FLOPs, reads and kept rows are the connection's, and its activations grow by the kept
    rows (a 12-layer debug model, CPU)."""
    from mhar_titan.config import load_config
    from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory, report

    overrides = {k: v for k, v in FAMILIES[family.split()[0]].items()}
    if family == "mhc mean":
        overrides["mhc_exit"] = "mean"
    argv = ["--job.dump_folder", str(tmp_path), "--model.n_layers=12",
            *(f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())]
    cfg = load_config("train_configs/debug_baseline.toml", argv)
    text, _ = report(cfg, 1, "cpu")
    args = build_model_args(cfg)
    d, L = args.dim, 12
    n = 4
    if family == "dense":
        formula = L * (L + 3) // 2
    elif family == "hyper":
        formula = 2 * L * (n * (n + 2) + d * (n + 2) + 2 * d + 2)
    elif family == "hyper_static":
        formula = 2 * L * n * (n + 2)
    elif family.startswith("mhc"):
        formula = 2 * L * ((n * n + 2 * n) * n * d + n * n + 2 * n + 3)
        formula += n * n * d + n + 1 if family == "mhc" else 0
        assert 2 * L * (96 * d + 27) == formula - (n * n * d + n + 1 if family == "mhc" else 0)
    else:
        C = [4] * (L - 1) + [1]
        K = [(C[i] * (i + 2) * (4 if i == L - 1 else 1) // 64 + 1) * 64 for i in range(L)]
        formula = sum(d * K[i] + K[i] * C[i] * (i + 2) + C[i] * (i + 2) for i in range(L))
        formula += ((L + 1) * d + 2 * L * d if args.mudd_prepost_norm else 0) + 2 * (L - 1) * d
    assert f"  connection      {formula:>15,}  (models.args.connection_parameters)" in text
    assert formula == connection_parameters(args)
    connection = build_connection(args)
    forward, backward = connection.depth_reads()
    assert f"{connection.flops_per_token():>15,} forward" in text
    assert f"{forward:>15,} forward + {backward:,} backward rows of d" in text
    assert f"{connection.kept_rows('none'):>15,} rows of d beyond the baseline's under AC none" in text
    baseline = load_config("train_configs/debug_baseline.toml", ["--job.dump_folder", str(tmp_path),
                                                                  "--model.n_layers=12"])
    grown = (estimate_memory(build_meta_model(args), cfg, 1, "cpu").activations
             - estimate_memory(build_meta_model(build_model_args(baseline)), baseline, 1, "cpu").activations)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    assert grown == connection.kept_rows("none") * d * tokens * 4


def test_the_guides_cost_table_is_the_models():
    """docs/CONNECTIONS.md's table of 1b costs is what the cost model and the dry run's formulas give
    for each 1b config (4 x 1024 tokens per micro-batch, AC full, bf16)."""
    from mhar_titan.config import load_config
    from mhar_titan.dryrun import ac_mode, build_model_args

    root = pathlib.Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "CONNECTIONS.md").read_text()
    rows = {"`attnres_1b` (H = 1, fused, per call)": ("attnres_1b", []),
            "`mhar_1b` (H = 8, fused, per call)": ("mhar_1b", []),
            '`mhar_1b`, `routing_group_size = "auto"` (g = 11)': ("mhar_1b", ["--model.routing_group_size=auto"]),
            "`dense_1b`": ("dense_1b", []), "`mudd_1b`": ("mudd_1b", []),
            "`mudd_1b`, `mudd_prepost_norm = false`": ("mudd_1b", ["--model.mudd_prepost_norm=false"]),
            "`hyper_1b`": ("hyper_1b", []),
            "`hyper_1b`, `hyper_dynamic = false`": ("hyper_1b", ["--model.hyper_dynamic=false"]),
            "`mhc_1b`": ("mhc_1b", []), '`mhc_1b`, `mhc_exit = "mean"`': ("mhc_1b", ["--model.mhc_exit=mean"])}
    for label, (config, overrides) in rows.items():
        cfg = load_config(str(root / "train_configs" / f"{config}.toml"), overrides)
        args, t = build_model_args(cfg), cfg.training
        tokens, mode = t.local_batch_size * t.seq_len, ac_mode(cfg)
        connection, flops = build_connection(args), flops_per_token(args, t.seq_len)
        forward, backward = connection.depth_reads()
        line = (f"| {label} | {connection_parameters(args):,} | {100 * flops.routing / flops.total:.2f}% | "
                f"{forward:,} + {backward:,} | {depth_read_bytes(args, tokens, mode) / 1e9:.2f} GB | "
                f"{routing_step_bytes(args, tokens, mode) / 1e9:.2f} GB | {connection.kept_rows(mode)} |")
        assert line in doc, line
    # the n-stream state's share the text quotes for mhc_1b (micro-batch 4, AC full, 8 ranks) is the dry run's
    from mhar_titan.dryrun import build_meta_model, estimate_memory

    cfg = load_config(str(root / "train_configs" / "mhc_1b.toml"))
    args, t = build_model_args(cfg), cfg.training
    assert (t.local_batch_size, ac_mode(cfg), t.mixed_precision_param) == (4, "full", "bfloat16")
    rows = build_connection(args).state_rows("full")
    state = rows * args.dim * t.local_batch_size * t.seq_len * 2
    activations = estimate_memory(build_meta_model(args), cfg, 8, "cuda", "eager").activations
    quoted = (f"{rows} rows of d, {state / 2**30:.2f} GiB per rank in bf16, {100 * state / activations:.0f}% of the "
              f"{activations / 2**30:.2f} GiB activation estimate")
    assert quoted in " ".join(doc.split()), quoted


def test_dry_run_states_the_stream_states_share_of_the_activations_for_mhc_1b(tmp_path):
    """The memory plan of mhc_1b at micro-batch 4 under AC full (8 ranks, bf16) states the n-stream
    state: every block's input H (36 x 4 rows of d) and the learned exit's H (4 rows), 148 rows x
    1280 x 4096 tokens x 2 B, and its share of the activation estimate; a one-stream connection has
    no such line."""
    from mhar_titan.config import load_config
    from mhar_titan.dryrun import build_meta_model, estimate_memory, report

    root = pathlib.Path(__file__).resolve().parents[1]
    argv = ["--job.dump_folder", str(tmp_path), "--training.local_batch_size=4", "--activation_checkpoint.mode=full"]
    cfg = load_config(str(root / "train_configs" / "mhc_1b.toml"), argv)
    text, _ = report(cfg, 8, "cuda")
    args = ModelArgs.from_flavor("1b", **FAMILIES["mhc"])
    assert build_connection(args).state_rows("full") == 36 * 4 + 4
    state = (36 * 4 + 4) * 1280 * 4 * 1024 * 2
    activations = estimate_memory(build_meta_model(args), cfg, 8, "cuda", "eager").activations
    assert 0.5 < state / activations < 1
    line = [x for x in text.splitlines() if x.startswith("  stream state")]
    assert line == [f"  stream state    {148:>15,} rows of d of the n x d state H kept for the backward under AC full "
                    "(every block's input H, n rows where the baseline keeps its one stream; the read-out's): "
                    f"{state / 2**30:,.2f} GiB per rank, {100 * state / activations:.0f}% of the activation estimate "
                    f"({activations / 2**30:,.2f} GiB)"], line
    assert f"  activations     {activations / 2**30:>10.2f} GiB" in text
    mudd = load_config(str(root / "train_configs" / "mudd_1b.toml"), argv)
    assert "stream state" not in report(mudd, 8, "cuda")[0]
