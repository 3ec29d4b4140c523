"""Unusual inputs to the command-line value forms, the shared exit handler, routing under
torch.autocast and the fused kernels' reason for not running: the edges the happy-path tests of
tests/test_config_cli.py, tests/test_cli_pipes.py, tests/test_autocast_routing.py and
tests/test_console.py leave out. Every check takes seconds on CPU."""
from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from mhar_titan.config.parser import load_config, to_toml
from mhar_titan.errors import ConfigError

PYTHON = sys.executable


def value(override: str):
    """The value one ``--section.key=...`` override loads to (a [model] field from its overrides)."""
    name = override[2:].partition("=")[0]
    section, _, key = name.partition(".")
    obj = getattr(load_config(None, [override]), section)
    return obj.overrides[key] if section == "model" and not hasattr(obj, key) else getattr(obj, key)


# --------------------------------------------------------------------------- command-line value forms


@pytest.mark.parametrize("override, expected", [
    ("--optimizer.lr=.5", 0.5), ("--optimizer.lr=5.", 5.0), ("--optimizer.lr=05", 5.0),
    ("--optimizer.lr=1e-3", 1e-3), ("--optimizer.lr=1E-3", 1e-3), ("--optimizer.lr=.5e-3", 5e-4),
    ("--optimizer.lr=+.25", 0.25), ("--optimizer.lr= 0.5 ", 0.5), ("--optimizer.lr=1_000", 1000.0),
    ("--optimizer.lr=2", 2.0),
    ("--training.steps=05", 5), ("--training.steps=+5", 5), ("--training.steps=1_000", 1000),
    ("--training.steps=0x10", 16), ("--training.steps= 7", 7),
    ("--training.cuda_graphs=TRUE", True), ("--training.cuda_graphs= false ", False),
    ("--lr_scheduler.decay_ratio=.5", 0.5), ("--data.seed=05", 5),
    ("--model.routing_heads=08", 8), ("--model.routing_heads=kv", "kv"),
    ("--model.routing_group_size=auto", "auto"),
])
def test_numbers_and_booleans_load_as_typed(override, expected):
    got = value(override)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("override, expected", [
    ("--job.description=5", "5"), ("--job.description=true", "true"), ("--job.description= x ", " x "),
    ("--data.hub_name=1e-3", "1e-3"), ("--model.rope_scaling=llama3", "llama3"),
    ("--activation_checkpoint.selective_ac_option=02", "02"),
])
def test_string_keys_keep_the_text_as_typed(override, expected):
    assert value(override) == expected


@pytest.mark.parametrize("override, words", [
    ("--optimizer.lr=inf", "finite"), ("--optimizer.lr=nan", "finite"), ("--optimizer.lr=1e400", "finite"),
    ("--optimizer.lr=-1", "> 0"), ("--optimizer.lr=", "must be float"), ("--optimizer.lr=true", "must be float"),
    ("--optimizer.lr=Infinity", "must be float"),
    ("--training.steps=5.0", "must be int"), ("--training.steps=1e3", "must be int"),
    ("--training.steps=True", "must be int"), ("--training.steps=5_", "must be int"),
    ("--training.cuda_graphs=yes", "must be bool"), ("--training.cuda_graphs=1", "must be bool"),
    ("--training.memory_check=WARN", "one of 'error', 'warn', 'off'"),
    ("--model.routing_group_size=AUTO", "int or 'auto'"), ("--model.routing_heads=8.0", "int or str"),
    ("--model.routing_logit_scale=nan", "finite"),
])
def test_bad_values_are_refused_naming_the_key(override, words):
    name = override[2:].partition("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert name in message and words in message and "\n" not in message


@pytest.mark.parametrize("override, expected", [
    ("--data.files=a.parquet,b/*.parquet", ["a.parquet", "b/*.parquet"]),
    ("--data.files= a.parquet , b.parquet ", ["a.parquet", "b.parquet"]),
    ("--data.files=[ab].parquet", ["[ab].parquet"]),
    ("--data.files=data/[ab]", ["data/[ab]"]),
    ("--data.files=x[0-9].parquet,[!a]b", ["x[0-9].parquet", "[!a]b"]),
    ("--data.files=file with space.parquet", ["file with space.parquet"]),
    ("--data.files=['a.parquet']", ["a.parquet"]),
    ('--data.files=[ "a.parquet", "b.parquet" ] ', ["a.parquet", "b.parquet"]),
    ("--data.files=", []), ("--data.files=,", []), ("--data.files=[]", []),
    ("--compile.components= model , loss ", ["model", "loss"]),
    ("--debug.force_nonfinite_loss_steps=3,5", [3, 5]), ("--debug.force_nonfinite_loss_steps=[3, 05]", [3, 5]),
    ("--debug.force_nonfinite_loss_steps=0x10,1_000", [16, 1000]), ("--debug.force_nonfinite_loss_steps=", []),
    ("--optimizer.muon_ns_coefficients=.5,-.5,5.", [0.5, -0.5, 5.0]),
    ("--optimizer.muon_ns_coefficients=[.5,-.5,5.]", [0.5, -0.5, 5.0]),
])
def test_list_forms_load_their_items(override, expected):
    got = value(override)
    assert got == expected and all(type(g) is type(e) for g, e in zip(got, expected))


def test_integer_items_of_a_float_list_load_as_floats_and_survive_the_written_config(tmp_path):
    cfg = load_config(None, ["--optimizer.muon_ns_coefficients=1,2,3"])
    assert cfg.optimizer.muon_ns_coefficients == [1.0, 2.0, 3.0]
    assert all(type(c) is float for c in cfg.optimizer.muon_ns_coefficients)
    written = tmp_path / "resolved.toml"
    written.write_text(to_toml(cfg))
    assert load_config(str(written)).optimizer.muon_ns_coefficients == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("override, words", [
    ("--debug.force_nonfinite_loss_steps=3,x", "list of int"), ("--debug.force_nonfinite_loss_steps=3.0", "list of int"),
    ("--debug.force_nonfinite_loss_steps=3 5", "list of int"), ("--debug.force_nonfinite_loss_steps=true", "list of int"),
    ("--debug.force_nonfinite_loss_steps=[1, \"2\"]", "list of int"),
    ("--optimizer.muon_ns_coefficients=1,2,inf", "muon_ns_coefficients[2]' must be a finite number"),
    ("--optimizer.muon_ns_coefficients=-inf,1,1", "muon_ns_coefficients[0]' must be a finite number"),
    ("--optimizer.muon_ns_coefficients=1,2", "three finite numbers"),
    ("--data.files=[1, 2]", "list of str"),
    ("--compile.components=[whole_model]", "--compile.components='[\"whole_model\"]'"),
    ("--optimizer.no_decay=[embeddings]", "--optimizer.no_decay=embeddings"),
])
def test_bad_list_values_are_refused_in_one_line(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, comma, array", [
    ("data.files", "a.parquet,b/[ab]*.parquet", '["a.parquet", "b/[ab]*.parquet"]'),
    ("compile.components", "model,loss", '["model", "loss"]'),
    ("optimizer.muon_ns_coefficients", "3,-4.5,2", "[3, -4.5, 2]"),
    ("debug.force_nonfinite_loss_steps", "3,5", "[3, 5]"),
    ("eval.tasks", "hellaswag,arc_easy", '["hellaswag", "arc_easy"]'),
])
def test_the_comma_form_the_quoted_array_and_the_toml_file_load_alike(tmp_path, key, comma, array):
    section, _, name = key.partition(".")
    config = tmp_path / "job.toml"
    config.write_text(f"[{section}]\n{name} = {array}\n")
    from_file = getattr(getattr(load_config(str(config)), section), name)
    assert getattr(getattr(load_config(None, [f"--{key}={comma}"]), section), name) == from_file
    assert getattr(getattr(load_config(None, [f"--{key}={array}"]), section), name) == from_file
    assert getattr(getattr(load_config(None, [f"--{key}", comma]), section), name) == from_file


@pytest.mark.parametrize("body", ['[compile]\ncomponents = "whole_model"', '[data]\nfiles = "a.parquet"',
                                  '[debug]\nforce_nonfinite_loss_steps = [3.0]', "[optimizer]\nlr = inf"])
def test_a_toml_file_with_a_scalar_for_a_list_or_a_non_finite_number_is_refused_naming_the_key(tmp_path, body):
    config = tmp_path / "job.toml"
    config.write_text(body + "\n")
    section, key = body[1:].split("]")[0], body.split("\n")[1].split(" =")[0]
    with pytest.raises(ConfigError, match=rf"'{section}\.{key}' must be"):
        load_config(str(config))


# --------------------------------------------------------------------------- the shared exit handler


def _run_main(body: str, *extra: str) -> subprocess.CompletedProcess:
    """A command whose __main__ is run_command(main), main defined by ``body`` (no torch import)."""
    script = "from mhar_titan.cli_args import run_command\n" + textwrap.dedent(body) + "\nrun_command(main)\n"
    return subprocess.run([PYTHON, "-c", script, *extra], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("returns, status", [("None", 0), ("0", 0), ("2", 2), ("1", 1), ("7", 7)])
def test_run_command_exits_with_mains_status(returns, status):
    done = _run_main(f"def main():\n    print('out')\n    return {returns}")
    assert (done.returncode, done.stdout, done.stderr) == (status, "out\n", "")


def test_run_command_keeps_argparse_errors_and_a_string_status():
    done = _run_main("""
        from mhar_titan.cli_args import ArgumentParser
        def main():
            ArgumentParser(prog="cmd").parse_args(["--nope"])
        """)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unrecognized arguments: --nope" in done.stderr
    done = _run_main("def main():\n    return 'cmd: bad input'")
    assert (done.returncode, done.stderr) == (1, "cmd: bad input\n")


def test_run_command_ends_an_interrupt_in_one_line_and_lets_other_errors_through():
    done = _run_main("def main():\n    raise KeyboardInterrupt")  # Ctrl-C: one line, then death by SIGINT
    assert done.returncode == -signal.SIGINT and done.stderr == "-c: interrupted (Ctrl-C)\n"
    done = _run_main("from mhar_titan.cli_args import Interrupted\ndef main():\n    raise Interrupted('x aborted')")
    assert done.returncode == -signal.SIGINT and done.stderr == "x aborted\n"
    done = _run_main("def main():\n    raise BrokenPipeError('a socket, not stdout')")
    assert done.returncode == 1 and "BrokenPipeError: a socket, not stdout" in done.stderr


def test_a_config_error_through_the_training_command_is_one_line_exit_2(warm_python):
    done = warm_python.run(["train.py", "--debug.force_nonfinite_loss_steps=3,x"], timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "'debug.force_nonfinite_loss_steps' must be list of int" in done.stderr


# --------------------------------------------------------------------------- routing under torch.autocast

from mhar_titan.models import ModelArgs, Transformer  # noqa: E402
from mhar_titan.models.args import FAMILIES  # noqa: E402

SHAPE = dict(dim=64, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=256, max_seq_len=32)
ROUTED = [family for family, fields in FAMILIES.items() if fields["residual"] != "standard"]
GROUPED = [(family, group) for group in (1, 2) for family in ROUTED
           if group == 1 or FAMILIES[family]["residual"] == "attn_res"]
"""(family, routing group size): groups of 2 sites for depth routing only (the other connections have
no routing sites)."""


def _model(family: str, group=1, ac: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], routing_group_size=group))
    model.init_weights()
    with torch.no_grad():  # off the zero init, so the depth softmax is not uniform
        for p in model.routing.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    if ac:
        from mhar_titan.parallel import apply_ac

        apply_ac(model, types.SimpleNamespace(mode="full", selective_ac_option="1", preserve_rng_state=True))
    return model


def _grads(model) -> dict:
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family, group", GROUPED)
def test_fp16_autocast_trains_every_routed_family_and_full_ac_recomputes_it_exactly(family, group):
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for ac in (False, True):
        model = _model(family, group, ac)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        runs.append((loss.detach(), _grads(model)))
    (loss, grads), (ac_loss, ac_grads) = runs
    assert math.isfinite(loss.item()) and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert torch.equal(loss, ac_loss)
    assert all(torch.equal(grads[n], ac_grads[n]) for n in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["mhar H=8", "delta block H=8 +null"])
def test_kv_cache_sampling_under_autocast_draws_the_uncached_tokens(dtype, family):
    from mhar_titan.eval.generation import generate

    model = _model(family, group=2).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # sharper logits, so sampling tells the paths apart
    prompt = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype):
        cached = generate(model, prompt, 12, temperature=1.0, seed=3, use_cache=True)
        uncached = generate(model, prompt, 12, temperature=1.0, seed=3, use_cache=False)
    assert torch.equal(cached, uncached)


def test_routing_statistics_under_autocast_stay_close_to_fp32():
    from mhar_titan.analysis.routing import routing_entropy

    model = _model("mhar H=8").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = routing_entropy(model, x)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert routing_entropy(model, x) == pytest.approx(reference, abs=1e-3)


# --------------------------------------------------------------------------- why the fused kernels do not run

try:
    import triton as _triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


@pytest.mark.skipif(not HAVE_TRITON, reason="the reasons other than 'triton is not installed' need triton")
@pytest.mark.parametrize("device, dim, heads, words", [
    ("meta", 64, 8, "not on meta"), ("mps", 64, 8, "not on mps"),
    ("cuda", 16384, 1, "d=16384, H=1 exceeds the kernels' register budget"),
    ("cuda:1", 16384, 1, "d=16384, H=1 exceeds"), (torch.device("cuda", 0), 64, 8, None), ("cuda", 64, 8, None),
])
def test_why_not_names_the_device_or_the_tile(device, dim, heads, words):
    from mhar_kernels import dispatch, op

    for why in (op.why_not(device, dim, heads), dispatch.fused_unavailable(device, dim, heads)):
        assert why is None if words is None else words in why


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_the_cpu_reason_follows_the_interpreter_setting():
    from mhar_kernels import op
    from mhar_kernels.routing_kernels import INTERPRET

    why = op.why_not(torch.device("cpu"), 64, 8)
    assert (why is None) if INTERPRET else "TRITON_INTERPRET=1" in why
    big = op.why_not(torch.device("cpu"), 16384, 1)
    assert "register budget" in big if INTERPRET else "TRITON_INTERPRET=1" in big


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_the_warning_and_the_plan_give_the_same_reason():
    from mhar_kernels import dispatch
    from mhar_titan.components.performance import planned_routing, routing_kernel_warning

    args = ModelArgs(**{**SHAPE, "dim": 16384, "n_heads": 64, "n_kv_heads": 64}, residual="attn_res",
                     routing_heads=1, routing_kernel="triton")
    reason = dispatch.fused_unavailable("cpu", 16384, 1)
    assert reason in routing_kernel_warning(args, torch.device("cpu"))
    asked, runs, why = planned_routing(args, "cpu")
    assert (asked, runs) == ("triton", "eager") and why.endswith(reason)
    assert "register budget" in planned_routing(args, "cuda")[2]
    auto = ModelArgs(**SHAPE, residual="attn_res", routing_heads=8, routing_kernel="auto")
    assert routing_kernel_warning(auto, torch.device("cpu")) is None
    assert "chosen on CUDA only" in planned_routing(auto, "cpu")[2]
