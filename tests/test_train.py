"""The trainer: exact gradient accumulation, 2-rank parity, compile parity, non-finite guard,
config errors before any build, resolved config and JSONL output.

The 2-rank checks run under one torchrun launch (tests/dist_train_checks.py) and are
compared with 1-process references computed here: window sharding gives the same
per-step losses with activation checkpointing full or none, and 2 ranks x accumulation 2
gives the same masked-batch gradients. The launch exiting 0 shows the clean gloo exit.
"""
import gc
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import ROOT, metric_losses, read_metrics  # noqa: E402
from train_common import DEBUG_MHAR, SAMPLE, debug_argv, debug_cfg, full_grads, masked_micro_batches, rel_diff  # noqa: E402

from mhar_titan.config import load_config  # noqa: E402
from mhar_titan.optim import WarmupStableDecay  # noqa: E402
from mhar_titan.train import Trainer, main  # noqa: E402

pytestmark = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")


def run(cfg):
    """Train ``cfg``; returns (the losses its metrics.jsonl holds, the final weights)."""
    trainer = Trainer(cfg)
    try:
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return metric_losses(trainer.run_dir), weights


def masked_step_grads(cfg, world_size=None):
    """(loss, full gradients, accumulation steps, grad norm) of one masked step.

    ``cfg`` must have ``training.max_norm = 0``: clipping divides out any uniform
    gradient factor, so clipped gradients cannot show a wrong scale. ``world_size``
    overrides the trainer's loss scale factor (to show the comparison catches it).
    """
    assert cfg.training.max_norm == 0
    trainer = Trainer(cfg)
    if world_size is not None:
        trainer.env.world_size = world_size
    try:
        loss, norm, _, _ = trainer.train_step(masked_micro_batches(trainer, rank=0, world=1))
        return loss.item(), full_grads(trainer.model), trainer.grad_accum, norm.item()
    finally:
        trainer.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """1 process, global batch 8 = local 8, 5 steps: the reference for the 2-rank and compile tests."""
    root = tmp_path_factory.mktemp("ref")
    cfg = debug_cfg(root, "ref", "--training.steps=5", "--training.local_batch_size=8")
    losses, _ = run(cfg)
    return root, losses


@pytest.fixture(scope="session")
def masked_grads(tmp_path_factory):
    """(micro 8, accum 1) and (micro 2, accum 4) on the same masked global batch of 8, unclipped."""
    root = tmp_path_factory.mktemp("grads")
    out = {}
    for local in (8, 2):
        cfg = debug_cfg(root, f"g{local}", "--training.steps=1", f"--training.local_batch_size={local}",
                        "--training.global_batch_size=8", "--training.max_norm=0")
        out[local] = masked_step_grads(cfg)
    return out


def test_reference_run_learns_and_writes_run_folder(reference_run):
    root, losses = reference_run
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5
    run_dir = root / "ref"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in rows)
    for key in ("grad_norm", "grad_norm/routing_query", "grad_norm/rest", "lr", "tokens_per_s",
                "tokens_per_s_per_device", "peak_mem_gib", "routing_entropy", "routing_flops_share"):
        assert key in rows[0], key
    # zero-initialised queries: every site starts uniform, mean entropy = mean log(N_s) > 0
    assert rows[0]["routing_entropy"] > 1.0
    resolved = load_config(str(run_dir / "config.toml"))
    assert resolved.training.steps == 5 and resolved.model.overrides["routing_heads"] == 8


def test_gradient_accumulation_is_exact(masked_grads):
    (loss8, g8, accum8, norm8), (loss2, g2, accum2, norm2) = masked_grads[8], masked_grads[2]
    assert (accum8, accum2) == (1, 4)
    assert loss2 == pytest.approx(loss8, abs=1e-5)
    assert rel_diff(g2, g8) <= 1e-5
    assert norm2 == pytest.approx(norm8, rel=1e-5)
    assert norm8 > 1.0  # above the configured max_norm: clipping would have hidden a scale error


def test_gradient_comparison_detects_a_wrong_scale(masked_grads, tmp_path):
    """The unclipped comparison fails when the loss is scaled by a wrong world size."""
    _, g8, _, norm8 = masked_grads[8]
    cfg = debug_cfg(tmp_path, "half", "--training.steps=1", "--training.local_batch_size=2",
                    "--training.global_batch_size=8", "--training.max_norm=0")
    _, g_half, _, norm_half = masked_step_grads(cfg, world_size=0.5)
    assert rel_diff(g_half, g8) == pytest.approx(0.5, abs=1e-5)
    assert norm_half == pytest.approx(norm8 / 2, rel=1e-5)


@pytest.mark.slow
def test_compiled_blocks_match_eager(reference_run, tmp_path):
    _, eager = reference_run
    cfg = debug_cfg(tmp_path, "compiled", "--training.steps=2", "--training.local_batch_size=8",
                    "--compile.enable=true")
    compiled, _ = run(cfg)
    # warmup is 2 steps, so steps 1-2 use the same LR whatever training.steps is
    assert compiled == pytest.approx(eager[:2], abs=1e-4)


def test_forced_nan_step_is_skipped_and_counted(tmp_path):
    _, after_one = run(debug_cfg(tmp_path, "one", "--training.steps=1"))
    cfg = debug_cfg(tmp_path, "nan", "--training.steps=2", "--debug.force_nonfinite_loss_steps=[2]",
                    "--training.max_consecutive_nonfinite=2")
    losses, after_skip = run(cfg)
    assert math.isnan(losses[1])
    for k in after_one:  # the skipped step did not touch the weights
        torch.testing.assert_close(after_skip[k], after_one[k], rtol=0, atol=0)
    rows = read_metrics(tmp_path / "nan")
    assert rows[1]["step"] == 2 and rows[1]["loss"] == "nan" and rows[1]["nonfinite_skipped"] == 1


def _trained_state(cfg):
    """Weights, optimizer state (moments and step counts) and EMA averages after training ``cfg``."""
    trainer = Trainer(cfg)
    try:
        trainer.train()
        state = {f"model.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
        for i, (p, st) in enumerate(trainer.optimizer.state.items()):
            state.update({f"optim.{i}.{k}": v.detach().clone() for k, v in st.items()})
        state.update({f"ema.{k}": v.clone() for k, v in trainer.ema.averages.items()})
    finally:
        trainer.close()
    return state


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_skipped_step_leaves_weights_moments_and_ema_exactly(tmp_path, implementation):
    """A non-finite step changes nothing: with fused AdamW the skip is decided on the device
    (``components.step_guard``: found_inf, EMA weighted by the flag), with foreach on the host."""
    common = ["--training.ema_decay=0.9", f"--optimizer.implementation={implementation}"]
    after_one = _trained_state(debug_cfg(tmp_path, "one", "--training.steps=1", *common))
    after_skip = _trained_state(debug_cfg(tmp_path, "skip", "--training.steps=2", *common,
                                          "--debug.force_nonfinite_loss_steps=[2]",
                                          "--training.max_consecutive_nonfinite=2"))
    assert after_skip.keys() == after_one.keys()
    for k in after_one:
        torch.testing.assert_close(after_skip[k], after_one[k], rtol=0, atol=0, msg=k)
    assert read_metrics(tmp_path / "skip")[1]["nonfinite_skipped"] == 1


def test_consecutive_nan_steps_stop_the_run(tmp_path, capsys):
    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={tmp_path}", "--job.name=stop",
                 f"--data.files=[\"{SAMPLE}/train-*.parquet\"]", "--validation.enable=false",
                 "--training.seq_len=32", "--training.steps=6",
                 "--debug.force_nonfinite_loss_steps=[2, 3, 4]", "--training.max_consecutive_nonfinite=3"])
    assert code == 1
    err = capsys.readouterr().err
    assert "stopping at step 4" in err and "steps 2-4" in err
    rows = read_metrics(tmp_path / "stop")
    assert rows[-1]["step"] == 4 and rows[-1]["nonfinite_skipped"] == 3
    assert not dist.is_initialized()
    assert gc.isenabled()  # the loop disables automatic collection; an exception must not leave it off


@pytest.mark.parametrize("bad, needle", [
    ("--training.stpes=3", "training.stpes"),
    ("--optimizer.lr=fast", "optimizer.lr"),
    ("--trainer.steps=3", "[trainer]"),
    ("--model.routing_head=2", "model.routing_head"),
    ("--model.routing_heads=3", "model.routing_heads"),  # d=128 not divisible by H=3 (ModelArgs)
    ("--optimizer.lr=-1", "optimizer.lr"),  # torch's AdamW would raise only once the model is built
])
def test_bad_config_fails_before_anything_is_built(tmp_path, capsys, bad, needle):
    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={tmp_path}", bad])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # no run folder
    assert not dist.is_initialized()  # no process group, so no model either


# --------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory, torchrun):
    """The 2-rank checks, one torchrun launch for the module (its tests are marked distributed by the fixture)."""
    out = tmp_path_factory.mktemp("dist")
    proc = torchrun(ROOT / "tests" / "dist_train_checks.py", out, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "dist.json").read_text()), torch.load(out / "grads.pt")


def test_two_ranks_match_one_process(dist_results, reference_run):
    results, _ = dist_results
    _, reference = reference_run
    assert len(reference) == 5
    for ac in ("none", "full"):
        assert len(results[f"losses_{ac}"]) == 5, (ac, results[f"losses_{ac}"])
        diffs = [abs(a - b) for a, b in zip(results[f"losses_{ac}"], reference)]
        assert max(diffs) <= 1e-5, (ac, results[f"losses_{ac}"], reference)


@pytest.mark.parametrize("family", ["dense", "mudd", "mudd_plain"])
def test_depth_connections_on_two_ranks_match_one_process_and_ac_full_is_bitwise(connection_runs, family):
    """DenseFormer and MUDDFormer (both variants) under FSDP2 on 2 gloo ranks (local batch 4): the
    5 losses equal the 1-process run's (local batch 8, the same global batches) within 1e-5, with
    AC none and full; on one process AC full equals none bit for bit (the blocks recompute their
    mix, the depth buffer's writes included, exactly)."""
    one, two = connection_runs
    assert len(one[f"{family}_none"]) == 5 and one[f"{family}_full"] == one[f"{family}_none"]
    assert one[f"{family}_none"][-1] < one[f"{family}_none"][0]
    for ac in ("none", "full"):
        assert max(abs(a - b) for a, b in zip(two[f"{family}_{ac}"], one[f"{family}_none"])) <= 1e-5, (ac, two, one)


@pytest.fixture(scope="module")
def connection_runs(tmp_path_factory, torchrun):
    """({family_ac: losses} on 1 process at local batch 8, the same on 2 ranks: tests/dist_train_checks.py
    connections)."""
    from dist_train_checks import CONNECTIONS

    out = tmp_path_factory.mktemp("connections")
    one = {}
    for family, overrides in CONNECTIONS.items():
        for ac in ("none", "full"):
            cfg = debug_cfg(out / "one", f"{family}_{ac}", "--training.steps=5", "--training.local_batch_size=8",
                            f"--activation_checkpoint.mode={ac}", *overrides)
            one[f"{family}_{ac}"], _ = run(cfg)
    proc = torchrun(ROOT / "tests" / "dist_train_checks.py", out, "connections", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return one, json.loads((out / "connections.json").read_text())


def test_two_ranks_with_accumulation_match_gradients(dist_results, masked_grads):
    results, grads = dist_results
    loss8, g8, _, norm8 = masked_grads[8]
    assert results["masked_loss"] == pytest.approx(loss8, abs=1e-5)
    assert rel_diff(grads, g8) <= 1e-5
    assert results["masked_grad_norm"] == pytest.approx(norm8, rel=1e-5)


def test_permuted_head_layout_is_the_same_on_every_rank_and_after_resume(dist_results):
    """Issue 16, acceptance 4 on 2 ranks: ranks with different global RNG states route with one
    permutation (the seed's), in three runs; a 2-step run resumed to 3 steps gives the straight
    run's losses."""
    from mhar_kernels.reference import head_permutation

    results, _ = dist_results
    expected = head_permutation(len(results["permutations"][0][0]), 9).tolist()
    assert expected != sorted(expected)
    assert [perms for perms in results["permutations"]] == [[expected, expected]] * 3
    straight, resumed = results["losses_perm_straight"], results["losses_perm_resumed"]
    assert len(straight) == 3 and resumed == straight, (straight, resumed)


def test_two_rank_mixture_resumed_equals_straight(dist_results):
    """Issue 30, acceptance 1: a 2-rank data-mixture run (document sharding) stopped at step 2 and
    resumed to 4 has the straight run's losses and every source's position on every rank; its
    tokens per source are the dry run's plan (``planned_source_windows``) and add up to tokens_seen;
    validation reports the source with validation files and the overall loss."""
    from mhar_titan.data.mixture import planned_source_windows

    results, _ = dist_results
    straight, resumed = results["losses_mix_straight"], results["losses_mix_resumed"]
    assert len(straight) == 4 and resumed == straight, (straight, resumed)
    positions = results["positions_mix_straight"]
    assert positions == results["positions_mix_resumed"]  # (epoch, part, row, windows) of each source, each rank
    assert all(set(p) == {"plays01", "plays23"} and all(w[-1] > 0 for ws in p.values() for w in ws) for p in positions)
    tokens = results["source_tokens_mix_straight"]
    assert tokens == results["source_tokens_mix_resumed"]
    planned = planned_source_windows([0.7, 0.3], seed=42, sharding="document", dp_world=2, num_workers=0,
                                     local_batch_size=2, batches=4 * 2)
    assert [tokens["plays01"], tokens["plays23"]] == (planned * 32).tolist()
    last = [r for r in results["rows_mix_resumed"] if "loss" in r][-1]
    assert last["tokens_seen/plays01"] + last["tokens_seen/plays23"] == last["tokens_seen"] == 4 * 8 * 32
    vals = [r for r in results["rows_mix_straight"] if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4] and all(r["val_loss/plays01"] == r["val_loss"] for r in vals)
    assert [r["val_loss"] for r in vals] == [r["val_loss"] for r in results["rows_mix_resumed"] if "val_loss" in r]


def test_train_state_is_rank0s_on_every_rank(dist_results):
    """Rank 0 owns the W&B run; its id must reach every rank's train_state (the checkpoint keeps one copy)."""
    results, _ = dist_results
    states = results["train_states"]
    assert len(states) == 2 and states[0]["wandb_id"]
    assert states[1] == states[0]


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def saved_at_8(tmp_path_factory):
    """A run of 8 steps (an 8-step LR schedule) with a checkpoint at step 8."""
    root = tmp_path_factory.mktemp("resume")
    run(debug_cfg(root, "r", "--training.steps=8", "--checkpoint.enable=true"))
    return root


def test_resume_with_longer_schedule_uses_its_lr_from_the_first_step(saved_at_8):
    """Step 9 after a resume with training.steps 8 -> 24 uses the 24-step schedule's LR,
    not the one restored with the optimizer state; switching routing_kernel or raising
    max_seq_len does not block the resume (they do not change the weights)."""
    cfg = debug_cfg(saved_at_8, "r", "--training.steps=24", "--checkpoint.enable=true",
                    "--model.routing_kernel=compile", "--model.max_seq_len=1024")
    trainer = Trainer(cfg)
    try:
        assert trainer.state.step == 8
        sched = cfg.lr_scheduler
        new = WarmupStableDecay(24, sched.warmup_steps, sched.decay_ratio, sched.decay_type, sched.min_lr_factor)
        old = WarmupStableDecay(8, sched.warmup_steps, sched.decay_ratio, sched.decay_type, sched.min_lr_factor)
        expected = cfg.optimizer.lr * new.factor(9)
        assert abs(expected - cfg.optimizer.lr * old.factor(9)) > 0.1 * expected
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9)
        assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(expected, rel=1e-9)
    finally:
        trainer.close()


def test_checkpoint_for_another_model_exits_2_with_a_message(saved_at_8, capsys):
    config_before = (saved_at_8 / "r" / "config.toml").read_text()
    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={saved_at_8}", "--job.name=r",
                 f"--data.files=[\"{SAMPLE}/train-*.parquet\"]", "--validation.enable=false",
                 "--training.seq_len=32", "--training.steps=24", "--lr_scheduler.warmup_steps=2",
                 "--model.routing_heads=4"])
    assert code == 2
    err = capsys.readouterr().err
    assert "CheckpointMismatchError" in err and "routing_heads" in err and "Traceback" not in err
    assert not dist.is_initialized()
    assert (saved_at_8 / "r" / "config.toml").read_text() == config_before  # a failed start keeps it


def test_noop_resume_and_missing_data_keep_the_runs_config(saved_at_8, capsys):
    """Neither a resume with fewer steps (nothing to do) nor a failed start rewrites config.toml,
    and the nothing-to-do advice does not suggest --checkpoint.enable=false (that now refuses)."""
    run_dir = saved_at_8 / "r"
    config_before = (run_dir / "config.toml").read_text()
    assert main(debug_argv(saved_at_8, "r", "--training.steps=4", "--checkpoint.enable=true")) == 0
    out = capsys.readouterr().out
    assert "| nothing to do |" in out and "--job.name" in out and str(run_dir) in out
    assert "checkpoint.enable" not in out
    code = main(debug_argv(saved_at_8, "r", "--training.steps=24", "--checkpoint.enable=true",
                           f"--data.files=[\"{saved_at_8}/none-*.parquet\"]"))
    assert code == 2 and "none-*.parquet" in capsys.readouterr().err
    assert (run_dir / "config.toml").read_text() == config_before
    assert not (run_dir / "config.prev.toml").exists()


def test_missing_data_files_exit_2_with_a_message(tmp_path, capsys):
    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={tmp_path}", "--job.name=nodata",
                 f"--data.files=[\"{tmp_path}/none-*.parquet\"]", "--validation.enable=false",
                 "--checkpoint.enable=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "none-*.parquet" in err and "Traceback" not in err
    assert not dist.is_initialized()


def test_every_input_error_is_a_user_error_and_exits_2(tmp_path, capsys):
    """main() maps UserError to exit 2 with no list of classes: every error of the job's inputs
    derives from it; a shard degree the launch cannot have is one (found at launch, not parse)."""
    from mhar_titan.checkpoint import CheckpointError, CheckpointMismatchError
    from mhar_titan.components.run_folder import RunFolderError
    from mhar_titan.config import ConfigError, ConfigFileNotFoundError
    from mhar_titan.data import DataError, DataStateError, ManifestError, TokenizerFileError
    from mhar_titan.errors import UserError
    from mhar_titan.launch_env import LaunchEnvError

    for cls in (ConfigError, ConfigFileNotFoundError, CheckpointError, CheckpointMismatchError, RunFolderError,
                DataError, DataStateError, ManifestError, TokenizerFileError, LaunchEnvError):
        assert issubclass(cls, UserError), cls
    assert issubclass(ConfigFileNotFoundError, FileNotFoundError)  # callers that caught it still do
    code = main(debug_argv(tmp_path, "degree", "--parallelism.data_parallel_shard_degree=2"))
    assert code == 2
    err = capsys.readouterr().err
    assert "data_parallel_shard_degree=2" in err and "1 ranks" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before the run folder was made
    assert not dist.is_initialized()


def test_srun_without_torchrun_is_refused(tmp_path, monkeypatch, capsys):
    """SLURM tasks without torchrun's RANK/WORLD_SIZE would each train alone as rank 0."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    code = main(["--config", str(DEBUG_MHAR), f"--job.dump_folder={tmp_path}", "--job.name=srun",
                 f"--data.files=[\"{SAMPLE}/train-*.parquet\"]", "--checkpoint.enable=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "SLURM_NTASKS" in err and "torchrun_node.sh" in err
    assert not any(tmp_path.iterdir())
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- the run folder


def test_model_args_are_resolved_once_per_start(tmp_path, monkeypatch):
    """``python train.py`` resolves the job's model arguments once (the config parser's, kept on
    the config): the start-up checks, the memory check and the build size that one resolution for
    the tokenizer; the model trained is what one resolution with the tokenizer gives. A config
    changed after loading is resolved again."""
    import mhar_titan.models.args as model_args
    from mhar_titan.config.parser import job_model_args

    resolve, calls = model_args.resolve_model_args, []
    monkeypatch.setattr(model_args, "resolve_model_args", lambda *a, **k: calls.append(a) or resolve(*a, **k))
    built = []
    monkeypatch.setattr(Trainer, "train", lambda self: built.append(self.model_args) or self.state)
    argv = debug_argv(tmp_path, "once", "--training.steps=1")
    assert main(argv) == 0
    assert len(calls) == 1, calls
    cfg = load_config(None, argv)
    assert built == [resolve(cfg.model, cfg.training.seq_len, 50_257, "gpt2")]
    assert built[0].vocab_size == 50_304 and built[0].max_seq_len == model_args.ModelArgs.from_flavor("debug").max_seq_len
    calls.clear()
    assert job_model_args(cfg) is job_model_args(cfg) and calls == []
    cfg.training.seq_len = 4096
    assert job_model_args(cfg).max_seq_len == 4096 and len(calls) == 1


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A finished 1-step run without checkpoints (folder ``old``)."""
    root = tmp_path_factory.mktemp("folder")
    run(debug_cfg(root, "old", "--training.steps=1"))
    return root


@pytest.mark.parametrize("checkpoint", ["false", "true"])
def test_fresh_start_into_a_used_run_folder_exits_2_and_keeps_it(one_step_run, capsys, checkpoint):
    """Without a checkpoint to resume, a start into a folder holding a run refuses (exit 2)
    instead of truncating its metrics and overwriting its config."""
    run_dir = one_step_run / "old"
    metrics, config = (run_dir / "metrics.jsonl").read_text(), (run_dir / "config.toml").read_text()
    assert len(metrics.splitlines()) == 1
    code = main(debug_argv(one_step_run, "old", "--training.steps=3", f"--checkpoint.enable={checkpoint}"))
    assert code == 2
    err = capsys.readouterr().err
    assert "RunFolderError" in err and str(run_dir) in err and "Traceback" not in err
    assert "--job.name" in err and "delete or move" in err
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "config.toml").read_text() == config
    assert not dist.is_initialized()


def test_resume_keeps_changed_config_as_prev_and_truncates_metrics(tmp_path):
    """A resume from a complete checkpoint still works: metrics rows after the restored step
    (logged by the interrupted run) are dropped, and the earlier config.toml, differing in
    training.steps, is kept as config.prev.toml."""
    run(debug_cfg(tmp_path, "p", "--training.steps=1", "--checkpoint.enable=true"))
    run_dir = tmp_path / "p"
    with open(run_dir / "metrics.jsonl", "a") as f:  # the interrupted run logged step 2, saved no checkpoint
        f.write(json.dumps({"step": 2, "loss": 99.0}) + "\n")
    run(debug_cfg(tmp_path, "p", "--training.steps=2", "--checkpoint.enable=true"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] != 99.0 and math.isfinite(rows[1]["loss"])
    assert load_config(str(run_dir / "config.prev.toml")).training.steps == 1
    assert load_config(str(run_dir / "config.toml")).training.steps == 2


def test_second_training_into_a_locked_run_folder_exits_2(tmp_path, capsys):
    """Rank 0 holds an flock on <run>/.lock until close(); a second training into the folder
    (here: in the same process, a separate open file) is refused, and can start after close()."""
    first = Trainer(debug_cfg(tmp_path, "busy", "--training.steps=1"))
    try:
        code = main(debug_argv(tmp_path, "busy", "--training.steps=1"))
        assert code == 2
        err = capsys.readouterr().err
        assert "another training" in err and str(tmp_path / "busy") in err
    finally:
        first.close()
    assert not (tmp_path / "busy" / "metrics.jsonl").exists() or not (tmp_path / "busy" / "metrics.jsonl").read_text()
    second = Trainer(debug_cfg(tmp_path, "busy", "--training.steps=1"))  # the lock was released
    second.close()


def test_lock_is_released_when_the_holding_process_dies(tmp_path):
    """Another process holding the lock blocks a start; once it is killed the OS drops the lock."""
    run_dir = tmp_path / "held"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", str(run_dir / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,  # holds the lock until it is killed
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(debug_argv(tmp_path, "held", "--training.steps=1")) == 2
    finally:
        holder.kill()
        holder.wait()
    assert main(debug_argv(tmp_path, "held", "--training.steps=1")) == 0
