"""The study's byte-level tokenizer and its committed configs."""
import pytest

from mhar_titan.config import load_config
from mhar_titan.data import DataConfig, build_tokenizer
from mhar_titan.dryrun import build_model_args
from mhar_titan.experiments.sweep import load_sweep
from train_common import ROOT


def test_byte_tokenizer_needs_no_file_and_round_trips(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer="bytes", tokenizer_cache_dir=str(tmp_path / "empty")))
    assert (tok.n_vocab, tok.eos_id) == (257, 256)
    assert tok.encode("Aé<|endoftext|>") == [65, 195, 169, *b"<|endoftext|>"]
    assert tok.decode(tok.encode("ROMEO: ünïcödé") + [tok.eos_id]) == "ROMEO: ünïcödé"
    with pytest.raises(ValueError, match="reads no file"):
        build_tokenizer(DataConfig(tokenizer="bytes", tokenizer_file=str(tmp_path)))


def test_study_sweep_pairs_five_families_over_three_seeds():
    sweep = load_sweep(ROOT / "train_configs" / "sweeps" / "study_bytes.toml")
    assert [r.name for r in sweep.runs] == [f"{f}_s{s}" for s in (1, 2, 3)
                                           for f in ("baseline", "attnres", "mhar_h2", "mhar_h4", "mhar_h8")]
    args = build_model_args(sweep.runs[-1].config)
    assert (args.vocab_size, args.resolved_routing_heads, args.n_routing_sites) == (384, 8, 25)
    assert build_model_args(load_config(str(ROOT / "train_configs" / "study_bytes.toml"))).vocab_size == 384


def test_results_md_quotes_the_generated_family_table():
    """RESULTS.md shows the per-family table that the documented results command wrote into
    docs/study/RESULTS.md, unchanged, and links the plot it wrote."""
    def family_rows(text):
        return [line for line in text.splitlines() if line.startswith("| ") and "| 3 |" in line and "_s" not in line]

    generated = (ROOT / "docs" / "study" / "RESULTS.md").read_text()
    quoted = (ROOT / "RESULTS.md").read_text()
    assert len(family_rows(generated)) == 5 and family_rows(quoted) == family_rows(generated)
    assert "docs/study/loss_vs_tokens.png" in quoted and (ROOT / "docs" / "study" / "loss_vs_tokens.png").exists()
