"""Routing models exported as our own model type and reloaded (issue 14, acceptance 4, second half)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from mhar_titan.convert import ConversionError, export_mhar, export_pretrained, load_mhar  # noqa: E402
from mhar_titan.convert.__main__ import main as convert_main  # noqa: E402
from mhar_titan.convert.dcp_io import load_model_dcp, save_model_dcp  # noqa: E402
from mhar_titan.convert.mhar_format import load_mhar_weights  # noqa: E402
from mhar_titan.convert.safetensors_io import shard_paths  # noqa: E402
from mhar_titan.models import ModelArgs, Transformer  # noqa: E402

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def trained_like(**fields) -> Transformer:
    """A routing model whose every parameter (gates, pseudo-queries, nulls included) is random."""
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=320, max_seq_len=32,
                     residual="attn_res", routing_heads=4, **fields)
    torch.manual_seed(7)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.routing.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("fields", [
    dict(routing_mode="delta", routing_granularity="block", routing_block_layers=2, routing_null_source=True),
    dict(routing_mode="replace", routing_granularity="sublayer", qk_norm=True),
], ids=["delta-block-null", "replace-sublayer"])
def test_export_and_reload_gives_equal_logits(tmp_path, fields):
    model = trained_like(**fields)
    export_pretrained(model, tmp_path / "out", max_shard_bytes=100_000)  # auto: a routing model -> mhar
    assert len(shard_paths(tmp_path / "out")) > 1
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mhar_titan" and config["model_args"]["routing_mode"] == fields["routing_mode"]
    reloaded = load_mhar(tmp_path / "out")
    assert reloaded.args == model.args
    with torch.no_grad():
        assert torch.equal(model(TOKENS), reloaded(TOKENS))


@pytest.mark.parametrize("fields", [dict(residual="dense", dense_dilation=2), dict(residual="mudd"),
                                    dict(residual="mudd", mudd_prepost_norm=False), dict(residual="hyper"),
                                    dict(residual="hyper", hyper_rate=2, hyper_dynamic=False), dict(residual="mhc"),
                                    dict(residual="mhc", hyper_rate=2, mhc_exit="mean", mhc_init="prenorm",
                                         mhc_sinkhorn_iters=5)],
                         ids=["dense k=2", "mudd", "mudd plain", "hyper", "hyper static n=2", "mhc",
                              "mhc mean prenorm n=2"])
def test_depth_connections_export_as_remote_code_and_reload(tmp_path, fields):
    """DenseFormer, MUDDFormer, Hyper-Connections and mHC export as our model type (format auto: the
    remote code runs this package's Transformer, so every connection works as trained, its keys
    kept) and reload with equal logits; the stock formats refuse them in one line naming the
    connection."""
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=320, max_seq_len=32, **fields)
    torch.manual_seed(7)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.routing.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    export_pretrained(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mhar_titan" and config["model_args"]["residual"] == fields["residual"]
    reloaded = load_mhar(tmp_path / "out")
    assert reloaded.args == model.args
    with torch.no_grad():
        assert torch.equal(model(TOKENS), reloaded(TOKENS))
    for fmt, needle in (("hf", f"a {fields['residual']!r} model has no stock transformers architecture"),
                        ("authors", f"no authors' mode for residual={fields['residual']!r}")):
        with pytest.raises(ConversionError, match=needle) as err:
            export_pretrained(model, tmp_path / fmt, fmt=fmt)
        assert "\n" not in str(err.value)
        assert not (tmp_path / fmt).exists()


def test_commands_round_trip_a_routing_checkpoint(tmp_path):
    model = trained_like(routing_mode="delta", routing_granularity="sublayer", routing_null_source=True)
    save_model_dcp(model, tmp_path / "ckpt")
    assert convert_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "folder"), "--tokenizer", "bytes"]) == 0
    assert convert_main(["import", str(tmp_path / "folder"), str(tmp_path / "ckpt2")]) == 0
    with torch.no_grad():
        assert torch.equal(model(TOKENS), load_model_dcp(tmp_path / "ckpt2")(TOKENS))
    assert convert_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 2


def test_commands_refuse_a_non_empty_output_folder_and_keep_it(tmp_path, capsys):
    model = trained_like(routing_mode="delta", routing_granularity="sublayer", routing_null_source=True)
    save_model_dcp(model, tmp_path / "ckpt")
    assert convert_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "folder"), "--tokenizer", "bytes"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "folder").iterdir()}
    other = trained_like(routing_mode="delta", routing_granularity="block", routing_block_layers=2)
    save_model_dcp(other, tmp_path / "other")
    capsys.readouterr()
    assert convert_main(["export", str(tmp_path / "other"), str(tmp_path / "folder"), "--tokenizer", "bytes"]) == 2
    assert f"{tmp_path / 'folder'} exists and is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "folder").iterdir()} == before  # the first export kept
    assert convert_main(["import", str(tmp_path / "folder"), str(tmp_path / "ckpt")]) == 2
    assert "choose a new folder for the imported model" in capsys.readouterr().err


def test_loading_into_a_different_model_is_refused(tmp_path):
    model = trained_like(routing_mode="delta", routing_granularity="block", routing_block_layers=2)
    export_mhar(model, tmp_path / "out")
    other = Transformer(ModelArgs(**{**vars(model.args), "routing_heads": 2}))
    with pytest.raises(ConversionError, match="routing_heads: folder 4, model 2"):
        load_mhar_weights(other, tmp_path / "out")
    # fields that do not touch the weights may differ
    longer = Transformer(ModelArgs(**{**vars(model.args), "max_seq_len": 64}))
    load_mhar_weights(longer, tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(longer(TOKENS), model(TOKENS))


@pytest.mark.parametrize("damaged", ["data", "metadata"])
def test_a_truncated_checkpoint_is_one_checkpoint_error_for_every_loader(tmp_path, damaged, capsys):
    from mhar_titan.checkpoint import CheckpointError
    from mhar_titan.generate import main as generate_main

    model = trained_like(routing_mode="replace", routing_granularity="sublayer")
    folder = save_model_dcp(model, tmp_path / "checkpoints" / "step-3")
    victim = folder / ".metadata" if damaged == "metadata" else sorted(folder.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"step-3 cannot be read .* truncated or corrupted"):
        load_model_dcp(folder)
    assert generate_main([str(folder), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "step-3 cannot be read" in err and "Traceback" not in err
    assert convert_main(["export", str(folder), str(tmp_path / "out"), "--tokenizer", "gpt2"]) == 2  # a CheckpointError
    err = capsys.readouterr().err
    assert err.startswith("python -m mhar_titan.convert export: error: ") and "step-3 cannot be read" in err


def test_convert_errors_carry_the_program_and_command_prefix(tmp_path, capsys):
    """One line with the prefix the other commands print (``PROG COMMAND: error: ...``), exit 2."""
    for command, expected in (("export", "does not exist; pass a run folder"), ("import", "no config.json")):
        assert convert_main([command, str(tmp_path / "missing"), str(tmp_path / f"out-{command}")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"python -m mhar_titan.convert {command}: error: ") and expected in err
        assert err.count("\n") == 1


def test_a_run_folder_given_for_a_checkpoint_names_its_step_folders(tmp_path):
    model = trained_like(routing_mode="replace", routing_granularity="sublayer")
    for step in (20, 100):
        save_model_dcp(model, tmp_path / "run" / "checkpoints" / f"step-{step}")
    with pytest.raises(ConversionError, match=r"is a run folder, not a checkpoint.*newest: .*step-100"):
        load_model_dcp(tmp_path / "run")


def test_export_takes_a_run_folder_and_says_what_it_wrote(tmp_path, capsys):
    """A run folder exports its newest complete checkpoint (or --step), as generate and eval read
    it; the last line names the checkpoint, the step and the kind of folder; the errors say what
    is wrong with the argument itself."""
    import dataclasses

    from mhar_titan.checkpoint import MARKER

    routed = trained_like(routing_mode="replace", routing_granularity="sublayer")
    standard = Transformer(ModelArgs(**{**dataclasses.asdict(routed.args), "residual": "standard"}))
    standard.init_weights()
    run = tmp_path / "run"
    for step, model in ((20, standard), (100, routed)):
        save_model_dcp(model, run / "checkpoints" / f"step-{step}", tokenizer="bytes")
        marker = json.loads((run / "checkpoints" / f"step-{step}" / MARKER).read_text())
        (run / "checkpoints" / f"step-{step}" / MARKER).write_text(json.dumps({**marker, "step": step}))
    (run / "checkpoints" / "step-300").mkdir()  # a save that never finished: not complete
    (run / "checkpoints" / "step-300" / ".metadata").write_bytes(b"")
    capsys.readouterr()
    assert convert_main(["export", str(run), str(tmp_path / "newest")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"wrote {tmp_path / 'newest'} from {run / 'checkpoints' / 'step-100'} (step 100, 1 shard(s)): "
                           "a mhar_titan folder with remote code (MharTitanForCausalLM"), last
    reloaded = load_mhar(tmp_path / "newest")
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS), routed(TOKENS))
    assert convert_main(["export", str(run), str(tmp_path / "older"), "--step", "20"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "(step 20, 1 shard(s)): a stock Qwen3 folder (Qwen3ForCausalLM: transformers loads it without remote code)" \
        in last, last
    # what is wrong, said exactly; nothing written
    cases = [
        (["export", str(run), str(tmp_path / "a"), "--step", "50"], "has no complete checkpoint step-50; complete "
                                                                    "steps: [20, 100]"),
        (["export", str(run / "checkpoints" / "step-300"), str(tmp_path / "b")], "step-300 has no complete.json: "
                                                                                  "its save did not finish"),
        (["export", str(tmp_path / "nowhere"), str(tmp_path / "c")], "nowhere does not exist; pass a run folder"),
        (["export", str(tmp_path), str(tmp_path / "d")], "holds no complete checkpoint"),
        (["export", str(run), str(tmp_path / "e"), "--format", "hf"], "so format 'hf' cannot hold it; use format "
                                                                      "'mhar' (--format mhar"),
    ]
    for argv, expected in cases:
        assert convert_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1 and "mhar_titan.convert.export_mhar" not in err, (argv, err)
        assert not Path(argv[2]).exists()
    bare = save_model_dcp(routed, tmp_path / "converted")  # no tokenizer recorded
    assert convert_main(["export", str(bare), str(tmp_path / "f")]) == 2
    assert "names no tokenizer (the model was converted from a folder without tokenizer files); pass the one the " \
           "model was trained with: --tokenizer" in capsys.readouterr().err
