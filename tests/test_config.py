"""Job config: TOML + CLI precedence, strict validation, resolved-config round trip."""
import pytest
from helpers import ROOT

from mhar_titan.config import SECTIONS, ConfigError, JobConfig, load_config, to_toml


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_sections_use_torchtitan_names():
    assert SECTIONS == [
        "job", "model", "data", "optimizer", "lr_scheduler", "training", "parallelism",
        "activation_checkpoint", "compile", "checkpoint", "metrics", "validation", "eval", "profiling", "debug",
    ]


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    p = write(tmp_path, "[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = load_config(str(p), ["--training.steps=7", "--optimizer.weight_decay", "0.5"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert cfg.optimizer.weight_decay == 0.5  # "--key value" form
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int accepted for float
    assert cfg.job.name == "job"  # run name defaults to the file stem


def test_config_file_from_cli_and_list_and_bool_values(tmp_path):
    p = write(tmp_path, "[compile]\nenable = false\n")
    cfg = load_config(None, ["--config", str(p), "--compile.enable=true",
                             "--debug.force_nonfinite_loss_steps=[3, 4]", "--optimizer.no_decay=[\"norms\"]"])
    assert cfg.compile.enable is True
    assert cfg.debug.force_nonfinite_loss_steps == [3, 4]
    assert cfg.optimizer.no_decay == ["norms"]


def test_lists_on_the_command_line_take_one_item_or_commas():
    one = load_config(None, ["--data.files=data/x-*.parquet"])
    assert one.data.files == ["data/x-*.parquet"]
    two = load_config(None, ["--data.files", "a.parquet, more/*.parquet"])
    assert two.data.files == ["a.parquet", "more/*.parquet"]
    toml = load_config(None, ['--data.files=["a.parquet", "b.parquet"]'])
    assert toml.data.files == ["a.parquet", "b.parquet"]
    # a list of ints too (every list key: tests/test_config_cli.py)
    assert load_config(None, ["--debug.force_nonfinite_loss_steps=3,4"]).debug.force_nonfinite_loss_steps == [3, 4]


@pytest.mark.parametrize(
    "text, cli, needles",
    [
        ("[training]\nstpes = 5\n", [], ["training.stpes", "steps", "seq_len"]),
        ("[trainig]\nsteps = 5\n", [], ["[trainig]", "training", "optimizer"]),
        ("[training]\nsteps = \"five\"\n", [], ["training.steps", "int", "five"]),
        ("[optimizer]\nlr = \"1e-3\"\n", [], ["optimizer.lr", "float"]),
        ("[compile]\nenable = 1\n", [], ["compile.enable", "bool"]),
        ("", ["--training.seq_len=long"], ["training.seq_len", "int"]),
        ("", ["--metrics.log_frq=3"], ["metrics.log_frq", "log_freq"]),
        ("", ["--activation_checkpoint.mode=some"], ["activation_checkpoint.mode", "'selective'"]),
        ("", ["--optimizer.no_decay=[\"norm\"]"], ["optimizer.no_decay", "norms"]),
        ("[lr_scheduler]\ndecay_ratio = 1.5\n", [], ["lr_scheduler.decay_ratio"]),
        ("", ["--optimizer.lr=-1"], ["optimizer.lr", "> 0"]),
        ("", ["--optimizer.lr=0"], ["optimizer.lr", "> 0"]),
        ("", ["--optimizer.beta1=-0.1"], ["optimizer.beta1", "[0, 1)"]),
        ("", ["--optimizer.beta2=1"], ["optimizer.beta2", "[0, 1)"]),
        ("", ["--optimizer.eps=0"], ["optimizer.eps"]),
        ("", ["--optimizer.weight_decay=-0.1"], ["optimizer.weight_decay", ">= 0"]),
        ("[model]\nflavor = \"debug\"\nresidual = \"attn_res\"\n", ["--model.routing_heads=3"],
         ["'model.routing_heads' = 3", "H=3", "choose H among the divisors of d: 1, 2, 4, 8, 16, 32, 64, 128"]),
        ("", ["--model.flavr=debug"], ["model.flavr", "Valid keys of [model]: attn_mask_type, ", " dim, eos_id, ffn_dim, flavor, "]),
        ("[model]\nflavor = \"debug\"\nn_heads = 3\n", [], ["'model.n_heads' = 3"]),
        ("[training]\nseq_len = 64\n[model]\nmax_seq_len = 32\n", [], ["training.seq_len", "max_seq_len"]),
        ("", ["--training.loss_path=fused"], ["training.loss_path", "'chunked'", "'plain'"]),
        ("", ["--training.loss_chunk_tokens=0"], ["training.loss_chunk_tokens", ">= 1"]),
        ("", ["--parallelism.timeout_s=0"], ["parallelism.timeout_s", "> 0"]),
        ("", ["--parallelism.timeout_s=-30"], ["parallelism.timeout_s", "> 0"]),
        ("", ['--compile.components=["model","whole_model"]'], ["compile.components", "list it alone"]),
        ("", ['--compile.components=["graph"]'], ["compile.components", "'whole_model'"]),
        ("", ["--model.attn_mask_type=document"], ["'model.attn_mask_type' must be one of 'causal', 'block_causal'", "document"]),
        ("", ["--model.rope_per_document=true"], ["'model.rope_per_document' = True", "block_causal"]),
        ("[model]\nresidual = \"attn_res\"\n", ["--model.routing_group_size=2.5"],
         ["'model.routing_group_size' must be int or 'auto', got float 2.5"]),
        ("[model]\nresidual = \"attn_res\"\n", ["--model.routing_group_size=10"],
         ["'model.routing_group_size' = 10", "larger than the 9 routing sites", "choose 1..9, or 'auto'"]),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, cli, needles):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(str(p), cli)
    for needle in needles:
        assert needle in str(e.value)


def _float_keys():
    """(section, key) of every float setting of the schema, [model] overrides (ModelArgs) included."""
    import typing

    from mhar_titan.config.parser import _field_types, _model_arg_types

    def is_float(tp):  # float or Optional[float]; a list of floats is checked inside lists, below
        return tp is float or (typing.get_origin(tp) is not list and float in typing.get_args(tp))

    keys = [(s, k) for s in SECTIONS for k, tp in _field_types(type(getattr(JobConfig(), s))).items() if is_float(tp)]
    keys += [("model", k) for k, tp in _model_arg_types().items() if is_float(tp)]
    return keys


FLOAT_KEYS = _float_keys()


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e999", "+nan"])
def test_every_float_setting_refuses_nan_and_infinity_naming_the_key(tmp_path, raw):
    """On the command line and in the TOML file, for every float key of every section (no key of the
    schema documents infinity as meaningful), and inside lists."""
    assert {("optimizer", "lr"), ("training", "max_norm"), ("model", "rope_theta"),
            ("data", "hub_retry_backoff_s")} <= set(FLOAT_KEYS)
    for section, key in FLOAT_KEYS:
        for where, text, cli in ((f"--{section}.{key}", "", [f"--{section}.{key}={raw}"]),
                                 ("job.toml", f"[{section}]\n{key} = {raw}\n", [])):
            with pytest.raises(ConfigError) as e:
                load_config(str(write(tmp_path, text)), cli)
            msg = str(e.value)
            assert where in msg.split(": ")[0] and f"'{section}.{key}' must be a finite number" in msg, msg
            assert "\n" not in msg
    for cli in (f"--optimizer.muon_ns_coefficients=[1, {raw}, 2]", f"--optimizer.muon_ns_coefficients=1,{raw},2"):
        with pytest.raises(ConfigError, match=r"'optimizer.muon_ns_coefficients\[1\]' must be a finite number"):
            load_config(None, [cli])
    # inside a table of a list (a mixture source's weight): the message names the item and key
    with pytest.raises(ConfigError, match=r"'data.sources\[0\].weight' must be a finite number"):
        load_config(None, [f'--data.sources=[{{name = "a", weight = {raw}, files = ["x"]}}]'])


def test_finite_floats_still_pass():
    cfg = load_config(None, ["--optimizer.lr=1e-300", "--training.max_norm=0", "--model.rope_theta=5e5"])
    assert cfg.optimizer.lr == 1e-300 and cfg.training.max_norm == 0.0
    assert cfg.model.overrides["rope_theta"] == 5e5


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".", "/abs", "a\\b", "run/"])
def test_job_name_must_be_one_folder_name(name):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--job.name={name}"])
    msg = str(e.value)
    assert f"'job.name' = {name!r} must be one folder name" in msg and "job.dump_folder" in msg and "\n" not in msg


@pytest.mark.parametrize("key", ["job.save_config_file", "checkpoint.folder", "metrics.jsonl_file",
                                 "metrics.save_tb_folder", "profiling.save_traces_folder"])
@pytest.mark.parametrize("value", ["../outside", "/tmp/abs", "a/../../b"])
def test_names_inside_the_run_folder_stay_inside_it(key, value):
    with pytest.raises(ConfigError, match=rf"'{key}' = '{value}' must be a relative path inside the run folder"):
        load_config(None, [f"--{key}={value}"])
    assert load_config(None, [f"--{key}=sub/name"]) is not None


def test_cli_needs_section_and_value():
    with pytest.raises(ConfigError, match="--steps"):
        load_config(None, ["--steps=3"])
    with pytest.raises(ConfigError, match="needs a value"):
        load_config(None, ["--training.steps"])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(write(tmp_path, "[training\nsteps=1")))


def test_resolved_config_round_trips(tmp_path):
    p = write(tmp_path, "[training]\nsteps = 9\n[lr_scheduler]\ndecay_ratio = 0.2\n")
    cfg = load_config(str(p), ["--optimizer.no_decay=[\"norms\", \"routing\"]"])
    again = load_config(str(write(tmp_path, to_toml(cfg), "resolved.toml")))
    assert again.to_dict() == cfg.to_dict()


def test_model_overrides_checked_against_model_args(tmp_path):
    cfg = load_config(str(write(tmp_path, "[model]\nflavor = \"debug\"\nrouting_heads = 2\n")))
    assert cfg.model.overrides == {"routing_heads": 2}
    with pytest.raises(ConfigError, match="model.n_layer"):
        load_config(str(write(tmp_path, "[model]\nn_layer = 2\n")))
    with pytest.raises(ConfigError, match="model.n_layers"):
        load_config(None, ["--model.n_layers=two"])


def test_shipped_train_configs_validate():
    files = sorted((ROOT / "train_configs").glob("*.toml"))
    for f in files:
        load_config(str(f))


_LOADED = """
import glob, json, sys
from mhar_titan.config import load_config
for path in sorted(glob.glob("train_configs/*.toml")):
    load_config(path)  # parsed and validated, [model] checked against ModelArgs
print(json.dumps(sorted(sys.modules)))
"""


def test_loading_every_committed_config_loads_no_model_kernel_loader_or_manager():
    """Issue 20, acceptance 3, in a fresh interpreter: loading and validating every committed
    config loads no torch (so no module defining a torch.nn.Module), no kernel module, neither the
    data loader nor the checkpoint manager; `import mhar_titan.models.args` loads no kernel module
    (nor torch). The project modules loaded are printed."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    def loaded(code: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def heavy(modules: list[str]) -> list[str]:
        return [m for m in modules if m.split(".")[0] in ("torch", "triton", "mhar_kernels", "torchdata", "tiktoken")
                or m in ("mhar_titan.data.loader", "mhar_titan.checkpoint.manager", "mhar_titan.models.model",
                         "mhar_titan.models.router")]

    by_configs = loaded(_LOADED)
    print("loading the configs loaded:", [m for m in by_configs if m.startswith("mhar_titan")])
    assert "mhar_titan.models.args" in by_configs  # the [model] keys were really checked
    assert heavy(by_configs) == []
    by_args = loaded("import json, sys, mhar_titan.models.args; print(json.dumps(sorted(sys.modules)))")
    print("import mhar_titan.models.args loaded:", [m for m in by_args if m.startswith("mhar_titan")])
    assert heavy(by_args) == []
    assert heavy(loaded("import json, sys, torch; print(json.dumps(sorted(sys.modules)))"))  # the check can fail


def test_importing_config_loads_no_heavy_module():
    """The schema and parser import no checkpoint, data or model code (a fresh interpreter)."""
    import subprocess
    import sys

    heavy = ["torch.distributed.checkpoint", "torchdata", "tiktoken", "datasets", "mhar_titan.data.loader",
             "mhar_titan.models.model", "mhar_titan.checkpoint.manager"]
    code = f"import sys, mhar_titan.config; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Every control character (C0, DEL, C1), quotes, backslash, TOML syntax, and text outside the BMP.
_ALPHABET = ([chr(c) for c in range(0x20)] + ["\x7f", "\x85", "\x9f", '"', "'", "\\", "\"\"\"", "'''", "=", "#", "[",
             "]", "{", "}", ",", " ", "a", "Z", "0", ".", "é", "\u2028", "\ufeff", "\U0001F600"])


def _random_text(rng, max_len=24):
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(max_len + 1)))


def _random_float(rng):
    return rng.choice([0.0, 5e-324, 1.7976931348623157e308, rng.random(), 10 ** rng.uniform(-300, 300),
                       rng.uniform(0, 1e-3), float(rng.randrange(1, 10 ** 6))])


def test_every_resolved_config_reloads_to_an_equal_config(tmp_path):
    """Seeded property test: random strings (every control character), numbers and lists in
    the resolved config (``to_toml``) load back (``load_config``) to an equal config."""
    import random

    rng = random.Random(20261201)
    path = tmp_path / "resolved.toml"
    for case in range(400):
        cfg = load_config(None, [])
        cfg.job.description = _random_text(rng, 60)
        cfg.data.hub_path = _random_text(rng) or "x"  # an empty one is refused (parser.EMPTY_MEANS)
        cfg.data.files = [_random_text(rng) for _ in range(rng.randrange(4))]
        cfg.data.hub_data_files = [_random_text(rng) for _ in range(rng.randrange(3))]
        cfg.checkpoint.initial_load_path = rng.choice([None, _random_text(rng) or "x"])
        cfg.metrics.wandb_project = _random_text(rng) or "x"
        cfg.optimizer.lr = _random_float(rng) or 1e-3
        cfg.optimizer.weight_decay = _random_float(rng)
        cfg.optimizer.eps = _random_float(rng) or 1e-8
        cfg.training.steps = rng.randrange(1, 2 ** 62)
        cfg.debug.seed = rng.randrange(-2 ** 63, 2 ** 63)
        cfg.debug.force_nonfinite_loss_steps = [rng.randrange(1, 2 ** 40) for _ in range(rng.randrange(5))]
        path.write_text(to_toml(cfg), encoding="utf-8")
        again = load_config(str(path))
        assert again.to_dict() == cfg.to_dict(), case
