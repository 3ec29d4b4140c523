"""Every command line checks its flags while it parses them (mhar_titan.cli_args): a bad value
stops the command with one line naming the flag and exit status 2, before anything is loaded
(the run folders named here do not exist: a check made after loading would report that instead)."""
import argparse
import shlex

import pytest
import torch
from helpers import ROOT

from mhar_titan import cli_args
from mhar_titan.analysis.__main__ import main as analysis_main
from mhar_titan.convert.__main__ import main as convert_main
from mhar_titan.data.prepare_shakespeare import main as shakespeare_main
from mhar_titan.data.pretokenize import main as pretokenize_main
from mhar_titan.dryrun import main as dryrun_main
from mhar_titan.eval.__main__ import main as eval_main
from mhar_titan.experiments.__main__ import main as experiments_main
from mhar_titan.generate import main as generate_main

CPU_ONLY = cli_args.cuda_unavailable_reason() is not None
NOWHERE = "no/such/run"


def refusal(main, argv: list[str], capsys) -> str:
    """The one stderr line of a command line refused while parsing (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured.err
    return lines[0]


BAD_FLAGS = [  # (command, argv, flag named, words of the message)
    (generate_main, [NOWHERE, "--tokens", "-5"], "--tokens", "positive integer"),
    (generate_main, [NOWHERE, "--tokens", "0"], "--tokens", "positive integer"),
    (generate_main, [NOWHERE, "--top-k", "0"], "--top-k", "positive integer"),
    (generate_main, [NOWHERE, "--top-p", "1.5"], "--top-p", "(0, 1]"),
    (generate_main, [NOWHERE, "--temperature", "-1"], "--temperature", ">= 0"),
    (generate_main, [NOWHERE, "--temperature", "nan"], "--temperature", "finite"),
    (generate_main, [NOWHERE, "--step", "-1"], "--step", ">= 0"),
    (generate_main, [NOWHERE, "--device", "gpu"], "--device", "not a device"),
    (generate_main, ["--config", "c.toml", "--tokens", "-5"], "--tokens", "positive integer"),
    (eval_main, ["lm-eval", NOWHERE, "--tasks", "x", "--batch-size", "-3"], "--batch-size", "positive integer"),
    (eval_main, ["lm-eval", NOWHERE, "--tasks", "x", "--batch-size", "0"], "--batch-size", "positive integer"),
    (eval_main, ["lm-eval", NOWHERE, "--tasks", "x", "--limit", "0"], "--limit", "positive integer"),
    (eval_main, ["lm-eval", NOWHERE, "--tasks", "x", "--num-fewshot", "-1"], "--num-fewshot", ">= 0"),
    (eval_main, ["perplexity", NOWHERE, "--batch-size", "0"], "--batch-size", "positive integer"),
    (eval_main, ["perplexity", NOWHERE, "--seq-len", "-4"], "--seq-len", "positive integer"),
    (eval_main, ["perplexity", NOWHERE, "--batches", "0"], "--batches", "positive integer"),
    (analysis_main, ["heatmap", NOWHERE, "--batches", "0"], "--batches", "positive integer"),
    (analysis_main, ["heatmap", NOWHERE, "--dpi", "-200"], "--dpi", "positive integer"),
    (analysis_main, ["probe", NOWHERE, "--slices", "0"], "--slices", "positive integer"),
    (analysis_main, ["probe", NOWHERE, "--draws", "x"], "--draws", "not an integer"),
    (analysis_main, ["compare", NOWHERE, "-k", "0"], "-k", "positive integer"),
    (convert_main, ["export", NOWHERE, "out", "--max-shard-gb", "0"], "--max-shard-gb", "> 0"),
    (convert_main, ["import", NOWHERE, "out", "--max-seq-len", "-1"], "--max-seq-len", "positive integer"),
    (convert_main, ["export", NOWHERE, "out", "--step", "-2"], "--step", ">= 0"),
    (experiments_main, ["list", "s.toml", "--gpu-hours", "--mfu", "1.5"], "--mfu", "(0, 1]"),
    (experiments_main, ["results", "s.toml", "--dpi", "0"], "--dpi", "positive integer"),
    (dryrun_main, ["--config", "c.toml", "--world-size", "0"], "--world-size", "positive integer"),
    (dryrun_main, ["--config", "c.toml", "--memory-gib", "-8"], "--memory-gib", "> 0"),
    (shakespeare_main, ["--train-shards", "0"], "--train-shards", "positive integer"),
    (pretokenize_main, ["--files", "x", "--out", "y", "--bogus"], "--bogus", "unrecognized"),
]


@pytest.mark.parametrize("main, argv, flag, words", BAD_FLAGS,
                         ids=[" ".join(a[:1] + a[-2:]) for _, a, _, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_in_one_line_naming_it(main, argv, flag, words, capsys):
    line = refusal(main, argv, capsys)
    assert line.startswith("python -m mhar_titan.") and ": error: " in line, line
    assert f"argument {flag}" in line or flag in line, line
    assert words in line, line
    assert "max_new_tokens" not in line and "Traceback" not in line


DEVICE_COMMANDS = [
    (generate_main, [NOWHERE]), (eval_main, ["perplexity", NOWHERE]), (eval_main, ["lm-eval", NOWHERE, "--tasks", "x"]),
    (analysis_main, ["heatmap", NOWHERE]), (analysis_main, ["probe", NOWHERE]),
]


@pytest.mark.parametrize("main, argv", DEVICE_COMMANDS, ids=[" ".join(a[:1]) for _, a in DEVICE_COMMANDS])
def test_a_device_this_machine_lacks_is_refused_before_loading(main, argv, capsys):
    """``--device cuda`` on a CPU-only torch (or ``cuda:N`` past the GPU count): one line naming
    --device and why, exit 2, not a traceback from inside the model's load."""
    bad = "cuda" if CPU_ONLY else f"cuda:{torch.cuda.device_count()}"
    line = refusal(main, [*argv, "--device", bad], capsys)
    assert "argument --device" in line and "use --device cpu" in line or "CUDA device(s)" in line, line
    if CPU_ONLY:
        assert "CPU-only build" in line or "no CUDA GPU" in line, line


def readme_line(*words: str, doc: str = "README.md") -> list[str]:
    """The command line of ``doc`` (the README, or a guide in docs/) holding all of ``words``, split
    as a POSIX shell splits it (quotes and backslashes as bash reads them), its ``# comment`` dropped."""
    found = [line for line in (ROOT / doc).read_text().splitlines()
             if line.startswith("python -m ") and all(w in line for w in words)]
    assert len(found) == 1, found
    return shlex.split(found[0], comments=True)


@pytest.mark.skipif(not CPU_ONLY, reason="this torch has CUDA: the README's --device cuda line is valid here")
def test_the_readme_lm_eval_line_on_a_cpu_only_torch_says_so_in_one_line(capsys):
    argv = readme_line("mhar_titan.eval lm-eval", "--device cuda")
    assert argv[:3] == ["python", "-m", "mhar_titan.eval"]
    line = refusal(eval_main, argv[3:], capsys)
    assert line.startswith("python -m mhar_titan.eval lm-eval: error: argument --device: cuda: ") and \
        "use --device cpu" in line, line


def test_the_readme_stop_flag_means_a_blank_line():
    """docs/ANALYSIS.md's ``--stop "\\n\\n"``: the shell passes backslash-n twice; the command reads it
    as two newlines (its sampling itself: tests/test_analysis_runs.py)."""
    from mhar_titan.generate import parse_args

    argv = readme_line("mhar_titan.generate", "--stop", doc="docs/ANALYSIS.md")
    assert "\\n\\n" in argv  # what bash hands over: four characters
    _, args, _ = parse_args(argv[3:])
    assert args.stop == ["\n\n"]


@pytest.mark.parametrize("text, read", [
    ("\\n\\n", "\n\n"), ("a\\tb", "a\tb"), ("\\r\\n", "\r\n"), ("C:\\\\temp", "C:\\temp"), ("\\x41\\u00e9", "Aé"),
    ("\\q stays", "\\q stays"), ("tail\\", "tail\\"), ("\n", "\n"), ("Roméo: \\n", "Roméo: \n"), ("\\\\n", "\\n"),
])
def test_escaped_text_reads_the_documented_escapes_only(text, read):
    assert cli_args.escaped_text(text) == read


def test_the_flag_types_accept_their_ranges():
    assert cli_args.positive_int("1") == 1 and cli_args.non_negative_int("0") == 0
    assert cli_args.probability("1") == 1.0 and cli_args.non_negative_float("0") == 0.0
    assert cli_args.positive_float("0.5") == 0.5 and cli_args.device("cpu") == "cpu"
    for check, bad in ((cli_args.positive_int, "0"), (cli_args.non_negative_int, "-1"), (cli_args.probability, "0"),
                       (cli_args.positive_float, "inf"), (cli_args.device, "cuda:x")):
        with pytest.raises(argparse.ArgumentTypeError):
            check(bad)


def test_every_command_of_the_package_uses_the_shared_parser_and_flag_types():
    """Read from the sources of mhar_titan/: no command builds a plain ``argparse.ArgumentParser``
    (its errors are a usage block, not one line) and no flag takes a bare ``int`` / ``float``
    (a count of -5 or 0 would pass), but a seed."""
    import ast

    found = []
    for path in sorted((ROOT / "mhar_titan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "argparse.ArgumentParser":
                found.append(f"{path.name}: argparse.ArgumentParser")
            if name.endswith("add_argument"):
                flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "?"
                kind = next((ast.unparse(k.value) for k in node.keywords if k.arg == "type"), None)
                if kind in ("int", "float") and flag != "--seed":
                    found.append(f"{path.name}: {flag} type={kind}")
    assert found == []
