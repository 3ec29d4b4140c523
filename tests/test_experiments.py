"""Sweeps: expansion, paired data order, the resumable local launcher, SLURM emission."""
import hashlib
import math
import re
import shlex
import shutil
import subprocess

import pytest

from mhar_titan.analysis.compare import data_order
from mhar_titan.components.memory import MemoryFitError
from mhar_titan.dryrun import build_model_args
from mhar_titan.config import ConfigError
from mhar_titan.data import build_tokenizer, build_train_loader
from mhar_titan.experiments.launch import check_runs, gpu_hours, run_local, run_state, slurm_script, world_size_of
from mhar_titan.experiments.sweep import load_sweep, paired_baseline
from mhar_titan.models.args import logit_scale
from train_common import DEBUG_MHAR, ROOT, SAMPLE

SWEEPS = ROOT / "train_configs" / "sweeps"


def write_sweep(tmp_path, body, name="s"):
    path = tmp_path / f"{name}.toml"
    path.write_text(body)
    return path


def small_sweep(tmp_path, seeds="[1, 2]", extra=""):
    return write_sweep(tmp_path, f"""
[sweep]
name = "small"
base = "{DEBUG_MHAR}"
dump_folder = "{tmp_path / 'runs'}"
seeds = {seeds}
baseline = "baseline"
[sweep.set]
"training.seq_len" = 16
"training.local_batch_size" = 2
"data.files" = ["{SAMPLE}/train-*.parquet"]
"data.validation_files" = ["{SAMPLE}/validation-*.parquet"]
{extra}
[families]
baseline = "baseline"
attnres = "attn_res H=1"
mhar = {{ residual = "attn_res", routing_heads = [2, 4] }}
""")


def test_sweep_expands_to_the_expected_runs(tmp_path):
    sweep = load_sweep(small_sweep(tmp_path, extra='[sweep.grid]\n"optimizer.lr" = [1e-3, 3e-3]'))
    names = [r.name for r in sweep.runs]
    assert names == [f"{f}_lr{lr}_s{s}" for s in (1, 2) for lr in ("0.001", "0.003")
                     for f in ("baseline", "attnres", "mhar_h2", "mhar_h4")]
    run = sweep.runs[names.index("mhar_h4_lr0.003_s2")]
    cfg = run.config
    assert cfg.model.overrides == {"residual": "attn_res", "routing_heads": 4}
    assert (cfg.optimizer.lr, cfg.debug.seed, cfg.data.seed, cfg.training.seq_len) == (3e-3, 2, 2, 16)
    assert run.run_dir == tmp_path / "runs" / run.name and cfg.job.name == run.name
    assert run.group == "mhar_h4_lr0.003"
    assert paired_baseline(sweep, run).name == "baseline_lr0.003_s2"
    assert sweep.runs[names.index("baseline_lr0.001_s1")].config.model.overrides["residual"] == "standard"


def test_a_family_starts_from_a_family_table_row_and_adds_keys(tmp_path):
    """``family = "<row>"`` takes the row's [model] fields, the other keys are added or replace the
    row's, a list still expands; the arm names the row and the keys added."""
    path = small_sweep(tmp_path, seeds="[3]")
    path.write_text(path.read_text().replace("mhar = {", """\
tau = { family = "attn_res H=1", routing_logit_scale = "match_heads:4" }
learned = { family = "mhar H=8", routing_temperature = "learned", routing_heads = [2, 8] }
mhar = {"""))
    sweep = load_sweep(path)
    assert [r.name for r in sweep.runs] == ["baseline_s3", "attnres_s3", "tau_s3", "learned_h2_s3", "learned_h8_s3",
                                           "mhar_h2_s3", "mhar_h4_s3"]
    by = {r.family: r for r in sweep.runs}
    assert by["tau"].config.model.overrides == {"residual": "attn_res", "routing_heads": 1,
                                                "routing_logit_scale": "match_heads:4"}
    assert "--model.routing_logit_scale=match_heads:4" in by["tau"].overrides
    assert logit_scale(build_model_args(by["tau"].config).routing_logit_scale) == 0.5
    assert by["learned_h2"].config.model.overrides == {"residual": "attn_res", "routing_heads": 2,
                                                       "routing_temperature": "learned"}
    assert sweep.arms == {"baseline": "baseline", "attnres": "attn_res H=1",
                          "tau": "attn_res H=1 + routing_logit_scale=match_heads:4",
                          "learned_h2": "mhar H=8 + routing_temperature=learned + routing_heads=2",
                          "learned_h8": "mhar H=8 + routing_temperature=learned + routing_heads=8",
                          "mhar_h2": "residual=attn_res, routing_heads=2", "mhar_h4": "residual=attn_res, routing_heads=4"}
    assert paired_baseline(sweep, by["tau"]).name == "baseline_s3" and sweep.pairs == ()


@pytest.mark.parametrize("body, message", [
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[families]\nb = "nope"', "not a row"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1, 1]\n[families]\nb = "baseline"', "distinct"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\nbaseline="z"\n[families]\nb = "baseline"', "baseline 'z'"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[families]\nb = {{ routing_headz = 2 }}', "routing_headz"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[sweep.set]\n"job.name"="y"\n[families]\nb="baseline"',
     "sets itself"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[families]\nb = {{ family = "nope", routing_heads = 2 }}',
     "family b.family = 'nope' is not a row"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[families]\nt = {{ family = "attn_res H=1", '
     'routing_logit_scale = "match_heads:0" }}', "run t_s1: .*routing_logit_scale"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\n[families]\nt = {{ family = "attn_res H=1", '
     'routing_temperature = "hot" }}', "run t_s1: .*routing_temperature"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\npairs=[["b", "zz"]]\n[families]\nb="baseline"\nm="mhar H=8"',
     r"sweep.pairs: 'zz' is none of \['b', 'm'\]"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\npairs=[["m", "m"]]\n[families]\nb="baseline"\nm="mhar H=8"',
     "compares m with itself"),
    ('[sweep]\nname="x"\nbase="{base}"\nseeds=[1]\npairs=["b", "m"]\n[families]\nb="baseline"\nm="mhar H=8"',
     r"sweep.pairs must be a list of \[A, B\] name pairs"),
])
def test_bad_sweep_files_are_refused_naming_the_problem(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write_sweep(tmp_path, body.format(base=DEBUG_MHAR)))


def batch_hash(cfg, batches=10):
    tokenizer = build_tokenizer(cfg.data)
    loader = build_train_loader(cfg.data, tokenizer, dp_rank=0, dp_world=1, seq_len=cfg.training.seq_len,
                                local_batch_size=cfg.training.local_batch_size, seed=cfg.debug.seed)
    digest = hashlib.sha256()
    for _, (x, y) in zip(range(batches), loader):
        digest.update(x.numpy().tobytes() + y.numpy().tobytes())
    return digest.hexdigest()


def test_runs_of_one_seed_read_the_same_tokens_in_the_same_order(tmp_path):
    sweep = load_sweep(small_sweep(tmp_path))
    hashes = {r.name: batch_hash(r.config) for r in sweep.runs}
    for seed in (1, 2):
        assert len({h for name, h in hashes.items() if name.endswith(f"_s{seed}")}) == 1
    assert hashes["baseline_s1"] != hashes["baseline_s2"]  # the seed changes the order


def test_local_launcher_skips_finished_runs_and_resumes_an_interrupted_one(tmp_path):
    """Two real trainings of 4 steps (checkpoint every 2); the second stops after step 2 as if
    interrupted, then the same sweep is launched again: it resumes only that run."""
    from mhar_titan.train import main as train_main

    sweep = load_sweep(small_sweep(tmp_path, seeds="[1]", extra='"training.steps" = 4\n"checkpoint.interval" = 2\n"metrics.log_freq" = 1\n'
                                   '"validation.enable" = false\n"model.dim" = 32\n"model.n_heads" = 2\n'
                                   '"model.n_kv_heads" = 1\n"model.ffn_dim" = 64'))
    first, second = sweep.runs[:2]
    calls = []

    def runner(command):  # the training command in this process; the second run stops at step 2
        calls.append(command)
        args = command[2:] + (["--training.steps=2"] if len(calls) == 2 else [])
        return train_main(args)

    report = run_local(sweep, sweep.runs[:2], runner=runner, echo=lambda _: None)
    assert report.completed == [first.name] and report.stopped == second.name and len(calls) == 2
    assert (run_state(first), run_state(second)) == ("done", "resumable")
    finished_metrics = (first.run_dir / "metrics.jsonl").read_bytes()

    calls.clear()
    report = run_local(sweep, sweep.runs[:2], runner=lambda c: calls.append(c) or train_main(c[2:]),
                       echo=lambda _: None)
    assert report.skipped == [first.name] and report.completed == [second.name] and report.ok
    assert len(calls) == 1 and f"--job.name={second.name}" in calls[0]
    assert (first.run_dir / "metrics.jsonl").read_bytes() == finished_metrics
    steps = [int(line.split('"step": ')[1].split(",")[0])
             for line in (second.run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4]  # resumed at step 2, not restarted


def test_slurm_emission_passes_bash_n_and_the_dry_run(tmp_path, warm_python):
    """Every emitted line is `sbatch ... slurm/train.sbatch CONFIG overrides`; the arguments after
    train.sbatch pass the job's own preflight (DRY_RUN=1 slurm/torchrun_node.sh, as train.sbatch
    runs it) at 1 node x 8 GPUs."""
    sweep = load_sweep(SWEEPS / "paper_fineweb_100m.toml")
    assert len(sweep.runs) == 6 * 2 * 3
    script = tmp_path / "submit.sh"
    script.write_text(slurm_script(sweep, sbatch_args=["--time=12:00:00"]))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = [shlex.split(line) for line in script.read_text().splitlines() if line.startswith("sbatch ")]
    assert len(lines) == len(sweep.runs)
    for words, run in zip(lines, sweep.runs):
        job_args = words[words.index("slurm/train.sbatch") + 1:]
        assert job_args == [run.base, *run.overrides] and (ROOT / job_args[0]).is_file()
        assert {"--nodes=1", "--gpus-per-node=8", "--time=12:00:00", f"--job-name=paper_fineweb_100m-{run.name}"} \
            <= set(words)
    # the dry runs' Python: each a process of its own, forked from the warm interpreter
    env = {**warm_python.env(), "DRY_RUN": "1", "NNODES": "1", "NPROC_PER_NODE": "8", "PYTHON": warm_python.python}
    for words in (lines[0], lines[2], lines[3], lines[5]):  # baseline, MHAR, the scaled and the learned temperature
        job_args = words[words.index("slurm/train.sbatch") + 1:]
        done = subprocess.run([str(ROOT / "slurm" / "torchrun_node.sh"), *job_args], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        # the fit is checked against cuda:0 where there is one; else the last line says it was not
        assert re.search(r"^dry run: (OK|config valid, nothing trained; NOT checked: memory fit \(no cuda device)",
                         done.stdout, re.M), done.stdout[-2000:]
        assert "8 ranks x local 4 x grad accumulation 2" in done.stdout
    world = world_size_of(list(sweep.slurm_args))
    checked = check_runs(sweep.runs[:3], world)
    # no fit check without the ranks' memory: the line must not call the run OK
    assert len(checked) == 3 and all(re.search(r"at 8 ranks, memory estimate [0-9.]+ GiB per rank; dry run config "
                                               r"valid, nothing trained; NOT checked: memory fit", line)
                                     for line in checked), checked
    assert all("dry run OK" in line for line in check_runs(sweep.runs[:3], world, (80 * 2**30, "--memory-gib")))
    with pytest.raises(MemoryFitError, match=f"run {sweep.runs[0].name}: .*does not fit"):
        check_runs(sweep.runs[:1], world, (2**20, "--memory-gib"))


def test_slurm_emission_leaves_out_done_runs(tmp_path):
    sweep = load_sweep(small_sweep(tmp_path, seeds="[1]"))
    done = sweep.runs[0]
    (done.run_dir).mkdir(parents=True)
    (done.run_dir / "exit_status").write_text(f"status=completed\nexit_code=0\nstep={done.config.training.steps}\n")
    text = slurm_script(sweep)
    assert f"# {done.name}: done, not submitted" in text
    assert sum(line.startswith("sbatch ") for line in text.splitlines()) == len(sweep.runs) - 1
    shutil.rmtree(done.run_dir)
    assert run_state(done) == "new"


@pytest.mark.parametrize("size", ["100m", "350m", "1b"])
def test_paper_sweeps_expand_and_state_their_estimated_gpu_hours(size):
    path = SWEEPS / f"paper_fineweb_{size}.toml"
    sweep = load_sweep(path)
    families = ("baseline", "attnres", "mhar", "attnres_tau", "attnres_learned", "mhar_learned")
    assert [r.name for r in sweep.runs] == [f"{f}_lr{lr}_s{s}" for s in (1, 2, 3) for lr in ("0.0005", "0.001")
                                           for f in families]
    assert {r.config.model.flavor for r in sweep.runs} == {size}
    # each family's residual path, routing heads and the depth-logit scale and temperature the model resolves
    resolved = {}
    for r in sweep.runs:
        args = build_model_args(r.config)
        resolved.setdefault(r.family, set()).add(
            (args.residual, args.resolved_routing_heads if args.residual == "attn_res" else None,
             logit_scale(args.routing_logit_scale), args.routing_temperature))
    assert resolved == {"baseline": {("standard", None, 1.0, "fixed")}, "attnres": {("attn_res", 1, 1.0, "fixed")},
                        "mhar": {("attn_res", 8, 1.0, "fixed")},
                        "attnres_tau": {("attn_res", 1, 1 / math.sqrt(8), "fixed")},
                        "attnres_learned": {("attn_res", 1, 1.0, "learned")},
                        "mhar_learned": {("attn_res", 8, 1.0, "learned")}}
    assert sweep.arms["attnres_tau"] == "attn_res H=1 + routing_logit_scale=match_heads:8"
    assert sweep.pairs == (("attnres", "attnres_tau"), ("attnres_tau", "mhar"), ("attnres", "attnres_learned"),
                           ("mhar", "mhar_learned"))
    # paired by seed: the runs of one seed and learning rate differ only in [model]
    for seed, lr in ((1, 5e-4), (3, 1e-3)):
        members = [r for r in sweep.runs if r.seed == seed and r.config.optimizer.lr == lr]
        assert len(members) == len(families)
        assert len({str(data_order(r.config, 1.0)) for r in members}) == 1
        assert len({(r.config.training.steps, r.config.training.global_batch_size) for r in members}) == 1
    # FLOPs x tokens / (MFU x peak): 1.0e18 FLOPs at MFU 0.5 of 1e15 FLOP/s take 2000 s
    run = sweep.runs[0]
    tokens = run.config.training.steps * run.config.training.global_batch_size * run.config.training.seq_len
    flops = gpu_hours(run, 8, 0.5, 1e15) * 3600 * 0.5e15
    from mhar_titan.metrics import flops_per_token
    assert flops == pytest.approx(flops_per_token(build_model_args(run.config), run.config.training.seq_len).total
                                  * tokens)
    hours = sum(gpu_hours(r, 8, 0.35, 989e12) for r in sweep.runs)
    assert f"about {hours:.0f} GPU-hours for the 36 runs" in path.read_text()
    assert "6 x 2 x 3 = 36 paired runs" in path.read_text()


def test_launcher_reports_failures_and_unsaved_runs_and_goes_on(tmp_path):
    """A run that exits 2 (bad input) is reported and the next one still starts; a folder with
    metrics but no checkpoint (stopped before its first save) is reported, not started."""
    sweep = load_sweep(small_sweep(tmp_path, seeds="[1]"))
    unsaved = sweep.runs[1]
    unsaved.run_dir.mkdir(parents=True)
    (unsaved.run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert run_state(unsaved) == "unsaved"
    started, lines = [], []
    report = run_local(sweep, runner=lambda c: started.append(c) or 2, echo=lines.append)
    assert report.failed == [sweep.runs[0].name, *[r.name for r in sweep.runs[2:]]]
    assert report.unsaved == [unsaved.name] and not report.ok
    assert len(started) == len(sweep.runs) - 1 and any("move or delete the folder" in line for line in lines)
