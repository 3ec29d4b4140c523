"""``--help`` everywhere: ``python train.py --help [SECTION]`` / ``-h`` lists every config key with its
default and meaning, read from the config dataclasses (a new key appears with nothing else to edit);
every ``python -m mhar_titan.*`` command and subcommand answers ``--help`` with its usage, exit 0."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import typing
from dataclasses import dataclass, field

import pytest
from helpers import PATIENCE_S, ROOT

from mhar_titan.config import SECTIONS, ConfigError, JobConfig
from mhar_titan.config.help import config_help, field_descriptions, help_request
from mhar_titan.models.args import ModelArgs
from mhar_titan.train import main


def _every_key() -> list[tuple[str, str]]:
    """(section, key) of every key a job config has: each section dataclass's fields, [model]'s
    ModelArgs fields."""
    keys = []
    for section in SECTIONS:
        cls = typing.get_type_hints(JobConfig)[section]
        keys += [(section, f.name) for f in dataclasses.fields(cls) if f.name != "overrides"]
    return keys + [("model", f.name) for f in dataclasses.fields(ModelArgs)]


def test_help_lists_every_section_and_key_with_its_default_and_meaning(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py --config FILE [--section.key=value ...]")
    for section in SECTIONS:
        assert f"\n[{section}]  " in out, section
    for section, key in _every_key():
        assert re.search(rf"^  --{section}\.{key} = \S", out, re.M), f"{section}.{key}"
    # defaults as TOML values, choices, and the meaning under the key (the dataclass's docstring)
    assert '\n  --optimizer.name = "AdamW"  (one of \'AdamW\', \'Muon\')\n      "AdamW" or "Muon".\n' in out
    assert "\n  --training.steps = 10000  (int)\n" in out
    assert "\n  --optimizer.muon_lr = unset  (float or unset)\n      Muon's peak learning rate; None: lr" in out
    assert "\n  --training.max_norm = 1.0  (float)\n      Gradient clipping threshold on the global L2 norm; <= 0 " \
           "disables clipping.\n" in out
    # [model]'s ModelArgs keys carry the comment on their line; a mixture source's keys are listed too
    assert "\n  --model.routing_heads = 8  (int or str)\n      H; 1 = single-head AttnRes; \"kv\" = n_kv_heads\n" in out
    assert re.search(r"^  --data\.sources\[i\]\.weight = unset  \(float or unset\)\n      Share of the training", out,
                     re.M)


@pytest.mark.parametrize("argv, section", [
    (["--help", "training"], "training"), (["--help=eval"], "eval"), (["--config", "x.toml", "-h", "model"], "model"),
    (["--config", "x.toml", "--help"], None), (["-h"], None),
])
def test_help_for_one_section_prints_only_it(capsys, argv, section):
    assert main(argv) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"^\[(\w+)\]  ", out, re.M)
    assert shown == ([section] if section else SECTIONS)
    assert out.startswith("usage:") == (section is None)


def test_help_for_an_unknown_section_is_one_line_exit_2(capsys):
    assert main(["--help", "trainig"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"config error: --help trainig: unknown section; sections: {', '.join(SECTIONS)}"]


def test_help_is_not_taken_from_a_key_value():
    assert help_request(["--job.description", "--help"]) is None  # the description's value
    assert help_request(["--job.description=x", "--help"]) == (None,)
    assert help_request(["--training.steps", "5", "-h", "--x.y=1"]) == (None,)
    assert help_request(["--help", "model", "job", "--x.y=1"]) == ("model", "job")  # each section named
    both = config_help("model", "job")
    assert both == config_help("model") + "\n\n" + config_help("job")
    with pytest.raises(ConfigError, match="nosuch"):
        config_help("model", "nosuch")


@dataclass
class _Example:
    """``[example]``: a schema the way the config writes one."""

    plain: int = 3
    """The first sentence. More detail that --help leaves out."""
    commented: str = "x"  # a comment on the line
    table: list = field(default_factory=list)


def test_descriptions_come_from_the_attribute_docstring_or_the_line_comment():
    assert field_descriptions(_Example) == {"plain": "The first sentence. More detail that --help leaves out.",
                                            "commented": "a comment on the line", "table": ""}


def test_train_py_help_through_the_entry_point(warm_python):
    for flag in ("-h", "--help"):
        done = warm_python.run(["train.py", flag, "optimizer"], timeout=PATIENCE_S)
        assert done.returncode == 0 and done.stdout.startswith("[optimizer]  AdamW, or Muon"), done.stderr[-2000:]


def _entry_points() -> list[str]:
    """Every ``python -m mhar_titan.X`` command: packages with a __main__.py, modules run as scripts."""
    names = []
    for path in sorted((ROOT / "mhar_titan").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name == "__main__.py":
            names.append(".".join(rel.parts[:-1]))
        elif 'if __name__ == "__main__"' in path.read_text():
            names.append(".".join(rel.parts))
    return names


def test_every_module_command_and_subcommand_answers_help(warm_python):
    """Each `python -m COMMAND [SUBCOMMAND] --help` runs as a process of its own, forked from one warm
    interpreter (tests/warm_python.py: the imports are done once)."""
    commands = _entry_points()
    assert {"mhar_titan.models", "mhar_titan.eval", "mhar_titan.convert", "mhar_titan.dryrun"} <= set(commands)

    def run_all(argvs):  # four at a time
        done = []
        for first in range(0, len(argvs), 4):
            batch = argvs[first:first + 4]
            procs = [subprocess.Popen([warm_python.python, "-m", *argv, "--help"], cwd=ROOT, env=warm_python.env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in batch]
            done += [(argv, p.returncode, out, err) for argv, p in zip(batch, procs)
                     for out, err in [p.communicate(timeout=PATIENCE_S)]]
        return done

    subcommands = []
    for argv, code, out, err in run_all([[c] for c in commands]):
        assert code == 0 and out.startswith("usage: "), (argv, code, err[-2000:])  # (a wrapped tool's own prog)
        choices = re.search(r"^positional arguments:\n  \{([\w,-]+)\}", out, re.M)  # argparse's subcommands
        subcommands += [[argv[0], sub] for sub in choices.group(1).split(",")] if choices else []
    assert ["mhar_titan.eval", "paired"] in subcommands
    for argv, code, out, err in run_all(subcommands):
        assert code == 0 and out.startswith(f"usage: python -m {' '.join(argv)}"), (argv, code, err[-2000:])


def test_the_model_listing_takes_help_and_refuses_other_arguments(capsys):
    from mhar_titan.models.__main__ import main as listing

    with pytest.raises(SystemExit) as done:
        listing(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m mhar_titan.models [-h]")
    with pytest.raises(SystemExit) as done:
        listing(["debug"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.strip().splitlines() == [
        "python -m mhar_titan.models: error: unrecognized arguments: debug (see python -m mhar_titan.models --help)"]
    assert listing([]) == 0 and capsys.readouterr().out.startswith("flavor ")


def test_a_meaning_is_the_first_whole_sentence(capsys):
    assert main(["--help", "eval"]) == 0
    out = capsys.readouterr().out
    # "e.g." and a period inside parentheses do not end the sentence
    assert '      Folders of local lm-eval task YAML files (e.g. ["eval_tasks"]; relative to the working\n' \
           "      folder).\n" in out
    assert max(len(line) for line in out.splitlines()) <= 101


def test_no_arguments_say_what_to_pass_in_one_line(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: no job given: pass --config FILE") and \
        "python train.py --help" in err[0]
