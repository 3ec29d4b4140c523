"""The command line's forms of a config value do what ``python train.py --help`` says: every list key (of
every section, of ``[model]``'s ModelArgs and of a ``[[data.sources]]`` table) takes its items
comma-separated and as a TOML array, to the same list of its item type; no key has an annotation the
parser reads another way (a bare ``list`` / ``tuple`` / ``dict``); an unquoted TOML array (the shell
removed its quotes) is refused in one line with the quoted form to type."""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Literal

import pytest
from helpers import PATIENCE_S, ROOT

from mhar_titan.config import SECTIONS, ConfigError, JobConfig, load_config
from mhar_titan.config.data import MixtureSource
from mhar_titan.config.help import USAGE, config_help
from mhar_titan.config.parser import _field_types, _matches, _parse_cli_value, list_item_type
from mhar_titan.models.args import ModelArgs

BASE = ["--config", "train_configs/debug_mhar.toml"]
SAMPLES = {str: ["a.parquet", "b-*.parquet"], int: [3, 5], float: [0.5, -4.75], bool: [True, False]}


def _every_field() -> list[tuple[str, str, object]]:
    """(where, key, annotation) of every key a job config has."""
    hints = typing.get_type_hints(JobConfig)
    classes = [(s, hints[s]) for s in SECTIONS] + [("model", ModelArgs), ("data.sources[i]", MixtureSource)]
    return [(where, key, tp) for where, cls in classes for key, tp in _field_types(cls).items()
            if not (where == "model" and key == "overrides")]  # [model]'s holder of the ModelArgs keys, not a key


def _walk(tp):
    """``tp`` and every annotation inside it."""
    yield tp
    for arg in typing.get_args(tp):
        if typing.get_origin(tp) is not Literal:
            yield from _walk(arg)


def test_no_key_has_a_bare_list_tuple_or_dict_annotation():
    bare = [f"{where}.{key}: {tp}" for where, key, tp in _every_field()
            if any(t in (list, tuple, dict) for t in _walk(tp))]
    assert not bare, "name the item type (list[str], list[int], ...):\n" + "\n".join(bare)


def test_every_list_key_takes_its_items_comma_separated_and_as_a_toml_array():
    lists = {}
    for where, key, tp in _every_field():
        item = list_item_type(tp)
        if item is None:
            continue
        assert item in SAMPLES, f"{where}.{key}: a list of {item!r}, which the comma form cannot write"
        values = SAMPLES[item]
        comma = ",".join(str(v).lower() if item is bool else str(v) for v in values)
        array = json.dumps(values)
        for raw in (comma, array, comma.replace(",", ", ")):
            parsed = _parse_cli_value(raw, tp, f"{where}.{key}")
            assert parsed == values and _matches(parsed, tp), (where, key, raw, parsed)
        assert _parse_cli_value(str(values[0]).lower() if item is bool else str(values[0]), tp, key) == values[:1]
        assert _parse_cli_value("", tp, key) == []
        lists[f"{where}.{key}"] = item
    # the walk reached the keys of the report and the typed lists (a broken walk would check nothing)
    assert {"compile.components": str, "optimizer.no_decay": str, "optimizer.muon_groups": str,
            "optimizer.muon_ns_coefficients": float, "debug.force_nonfinite_loss_steps": int,
            "data.files": str, "data.sources[i].files": str, "eval.tasks": str}.items() <= lists.items()


@pytest.mark.parametrize("override, section, key, expected", [
    ("--compile.components=whole_model", "compile", "components", ["whole_model"]),
    ("--compile.components=model,loss", "compile", "components", ["model", "loss"]),
    ('--compile.components=["model", "loss"]', "compile", "components", ["model", "loss"]),
    ("--optimizer.no_decay=embeddings,norms", "optimizer", "no_decay", ["embeddings", "norms"]),
    ("--optimizer.muon_groups=other,head", "optimizer", "muon_groups", ["other", "head"]),
    ("--optimizer.muon_ns_coefficients=3.4445,-4.775,2.0315", "optimizer", "muon_ns_coefficients",
     [3.4445, -4.775, 2.0315]),
    ("--optimizer.muon_ns_coefficients=[3,-4,2]", "optimizer", "muon_ns_coefficients", [3.0, -4.0, 2.0]),
    ("--debug.force_nonfinite_loss_steps=3,5", "debug", "force_nonfinite_loss_steps", [3, 5]),
    ("--optimizer.lr=.5", "optimizer", "lr", 0.5),
])
def test_the_documented_forms_load(override, section, key, expected):
    value = getattr(getattr(load_config(None, BASE + [override]), section), key)
    assert value == expected and type(value) is type(expected)
    if isinstance(value, list):
        assert [type(v) for v in value] == [type(v) for v in expected]


@pytest.mark.parametrize("typed, quoted, comma", [
    ("[whole_model]", """'["whole_model"]'""", "whole_model"),
    ("[model,loss]", """'["model", "loss"]'""", "model,loss"),
    ("['model', loss]", """'["model", "loss"]'""", "model,loss"),
])
def test_an_unquoted_toml_array_of_strings_says_to_quote_it(typed, quoted, comma):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [f"--compile.components={typed}"])
    message = str(e.value)
    assert "\n" not in message and "the shell" in message
    assert f"--compile.components={quoted}" in message and f"--compile.components={comma}" in message
    # the forms the message offers load
    for offered in (quoted.strip("'"), comma):
        assert load_config(None, BASE + [f"--compile.components={offered}"]).compile.components == comma.split(",")


def test_a_bad_item_names_the_key_and_the_item_type():
    with pytest.raises(ConfigError, match=r"'debug\.force_nonfinite_loss_steps' must be list of int, got list "
                                          r"\[3, 'x'\]"):
        load_config(None, BASE + ["--debug.force_nonfinite_loss_steps=3,x"])
    with pytest.raises(ConfigError, match=r"'compile.components' has unknown entries \['modle'\]"):
        load_config(None, BASE + ["--compile.components=modle"])


def test_help_shows_each_list_keys_item_type_and_both_forms():
    assert "--compile.components = [\"model\"]  (list of str)" in config_help("compile")
    assert "--debug.force_nonfinite_loss_steps = []  (list of int)" in config_help("debug")
    assert "--optimizer.muon_ns_coefficients = " in config_help("optimizer")
    assert "(list of float)" in config_help("optimizer")
    assert "--compile.components=whole_model" in USAGE and """--compile.components='["model", "loss"]'""" in USAGE


def test_the_training_command_refuses_an_unquoted_array_in_one_line_exit_2(tmp_path, warm_python):
    done = warm_python.run(["train.py", *BASE, f"--job.dump_folder={tmp_path}", "--compile.components=[whole_model]"],
                           timeout=PATIENCE_S)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "config error: --compile.components=[whole_model]: not a TOML array (did the shell remove its quotes?); "
        """for the items ['whole_model'] write --compile.components='["whole_model"]' or """
        """--compile.components=whole_model; to keep ['[whole_model]'] as written, """
        """--compile.components='["[whole_model]"]' (quoted for the shell)"""]
    assert not any(tmp_path.iterdir())  # refused before the run folder was made


def test_dataclass_defaults_match_their_annotations():
    """Every default value fits its key's annotation (a list default of the item type)."""
    hints = typing.get_type_hints(JobConfig)
    for where, cls in [(s, hints[s]) for s in SECTIONS] + [("data.sources[i]", MixtureSource)]:
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not None and default is not dataclasses.MISSING:
                assert _matches(default, types_[f.name]), (where, f.name, default)


@pytest.mark.parametrize("tp, item, raw, expected", [
    (typing.Optional[list[str]], str, "a,b", ["a", "b"]),
    (typing.Optional[list[int]], int, "1, 2", [1, 2]),
    (list[float] | None, float, ".5,2", [0.5, 2]),
    (list[bool], bool, "true,False", [True, False]),
    (list[Literal["model", "loss"]], str, "model,loss", ["model", "loss"]),
    (list, str, "x,y", ["x", "y"]),  # a bare list (the schema has none: test above) reads strings
    (tuple[int, ...], int, "3", [3]),
])
def test_the_comma_form_reads_any_list_annotation_as_its_item_type(tp, item, raw, expected):
    assert list_item_type(tp) is item
    assert _parse_cli_value(raw, tp, "s.k") == expected


@pytest.mark.parametrize("tp", [str, int, typing.Optional[int], int | str, dict, list[MixtureSource]])
def test_other_annotations_are_not_read_as_comma_lists(tp):
    assert list_item_type(tp) is None


@pytest.mark.parametrize("value, files", [
    ("x/shard[0,1].parquet,y.parquet", ["x/shard[0,1].parquet", "y.parquet"]),  # commas inside brackets: one item
    ("[a,b].parquet", ["[a,b].parquet"]),
    ("""["[ab].parquet", "shard[0-9]"]""", ["[ab].parquet", "shard[0-9]"]),
])
def test_file_patterns_with_brackets_load_as_written(value, files):
    assert load_config(None, [f"--data.files={value}"]).data.files == files


@pytest.mark.parametrize("value", ["[ab].parquet,shard[0-9]", "[ab]"])
def test_a_bracketed_value_that_is_no_array_is_refused_with_forms_that_keep_every_item(value):
    """A value in brackets that is not a TOML array is refused; every form the message offers loads the
    items as written (or, for an array whose quotes the shell removed, its items)."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"--data.files={value}"])
    offered = [part.split(" as written, ")[-1].split(" write ")[-1].split(" (quoted")[0]
               for part in str(refused.value).split("; ")[1:]]
    forms = [form for part in offered for form in part.split(" or ")]
    assert forms, str(refused.value)
    loaded = [load_config(None, [form.replace("'", "")]).data.files for form in forms]
    as_written = [item.strip() for item in (["[ab].parquet", "shard[0-9]"] if "," in value else [value])]
    assert as_written in loaded, (forms, loaded)
    assert all(files in (as_written, ["ab"]) for files in loaded), (forms, loaded)


def test_a_key_without_its_value_does_not_take_the_next_key():
    with pytest.raises(ConfigError, match=r"--job.name needs a value: write --job.name=VALUE"):
        load_config(None, ["--job.name", "--training.steps=5"])
    assert load_config(None, ["--job.name", "x", "--training.steps=5"]).job.name == "x"


@pytest.mark.parametrize("value", ["\u0661\u0662", "\uff15", "5\nw = 6"])
def test_a_number_is_ascii_digits_and_one_value(value):
    """Non-ASCII digits (which Python's int() reads) and a value with a second TOML key are refused."""
    with pytest.raises(ConfigError, match="training.steps"):
        load_config(None, [f"--training.steps={value.encode().decode('unicode_escape')}"])


def test_an_int_for_an_optional_float_key_loads_as_a_float():
    assert repr(load_config(None, ["--lr_scheduler.decay_ratio=1"]).lr_scheduler.decay_ratio) == "1.0"


# --- empty values and paths of the wrong kind ---------------------------------------------------------


def test_an_empty_job_name_is_the_config_files_stem_as_help_says(tmp_path):
    """--help: "empty (or unset) means the config file's stem"; so it is from the command line and
    from the file, and "run" without a file."""
    config = str(ROOT / "train_configs" / "debug_mhar.toml")
    assert "empty (or unset) means the config file's stem" in config_help("job")
    assert load_config(config, ["--job.name="]).job.name == "debug_mhar"
    assert load_config(None, ["--config", config, "--job.name", ""]).job.name == "debug_mhar"
    named = tmp_path / "my_job.toml"
    named.write_text('[job]\nname = ""\n')
    assert load_config(str(named)).job.name == "my_job"
    assert load_config(None, ["--job.name="]).job.name == "run"


def test_an_empty_value_means_unset_for_an_optional_key_and_is_refused_where_it_means_nothing():
    """One rule for every string key (command line and file alike): an optional key's empty value is
    its default, None; a key whose empty value --help gives no meaning is refused in one line naming it."""
    cfg = load_config(None, ["--checkpoint.initial_load_path=", "--data.tokenizer_file=", "--job.description="])
    assert cfg.checkpoint.initial_load_path is None and cfg.data.tokenizer_file is None and cfg.job.description == ""
    for key in ("job.dump_folder", "data.text_field", "data.tokenizer", "metrics.wandb_project",
                "model.routing_logit_scale"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"--{key}="])
        assert f"'{key}' is empty ('')" in str(err.value) and "leave the key out for its default" in str(err.value)
    checked = [f"{section}.{f.name}" for section in SECTIONS for f in dataclasses.fields(getattr(JobConfig(), section))
               if _field_types(type(getattr(JobConfig(), section)))[f.name] is str]
    for key in checked:  # no plain string key takes an empty value silently
        try:
            load_config(None, [f"--{key}="])
        except ConfigError:
            continue
        assert key in ("job.name", "job.description"), key


def test_a_folder_given_for_a_file_is_called_a_folder_not_missing(tmp_path, capsys):
    """--config, a sweep file, a sweep's base config: a folder is "a folder, not a file"; a run given
    as a file is "a file, not a folder"; a missing path is still "not found"."""
    from mhar_titan.analysis.__main__ import main as analysis_main
    from mhar_titan.experiments.__main__ import main as experiments_main
    from mhar_titan.train import main as train_main

    configs = ROOT / "train_configs"
    with pytest.raises(ConfigError, match=f"config file {configs} is a folder, not a file; name a TOML file such as "):
        load_config(str(configs))
    assert train_main(["--config", str(configs)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: config file {configs} is a folder, not a file") and "\n" not in err
    assert experiments_main(["list", str(configs / "sweeps")]) == 2
    assert f"{configs / 'sweeps'} is a folder, not a file" in capsys.readouterr().err
    sweep = tmp_path / "s.toml"
    sweep.write_text(f'[sweep]\nname = "s"\nbase = "{configs}"\nseeds = [1]\n[families]\nbaseline = "baseline"\n')
    assert experiments_main(["list", str(sweep)]) == 2
    assert f"base config {configs} is a folder, not a file" in capsys.readouterr().err
    a_file = tmp_path / "metrics.jsonl"
    a_file.write_text("{}\n")
    assert analysis_main(["compare", str(a_file)]) == 2
    assert f"{a_file} is a file, not a folder: pass a run folder" in capsys.readouterr().err
    assert analysis_main(["heatmap", str(a_file)]) == 2
    assert f"{a_file} is a file, not a folder; pass a run folder" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.toml"))
