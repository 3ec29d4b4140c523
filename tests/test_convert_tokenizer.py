"""A Llama-3-style tokenizer read from tokenizer.model and from tokenizer.json encodes like
transformers' tokenizer for the same files (issue 14, acceptance 8)."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
from helpers import llama3_tokenizer_folder  # noqa: E402
from mhar_titan.data.hf_tokenizer import (  # noqa: E402
    HFTokenizerError, byte_to_unicode, is_hf_tokenizer_folder, load_hf_tokenizer,
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2026; we've seen 12345 foxes, they'll run!\n"
    "Attention residuals route over depth: sources, pseudo-queries and heads.\r\n  Indented    text\t tabs.\n"
    "Ünïcödé wörds, naïve café, 東京 and emoji 🦊 too. Numbers like 3.14159 and 1,000,000.\n"
) * 3
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
TEXTS = [
    "Hello world, it's a test.",
    "The lazy fox's 98765 jumps\n\n  over   Ünïcödé 東京 🦊!",
    "<|begin_of_text|>Some text<|end_of_text|>",
    "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
    "unseen words: zyxw qvbj, and sp<|eot_id|>lit tokens",
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A model folder with original/tokenizer.model (tiktoken BPE trained on CORPUS), the
    tokenizer.json transformers converts it to, and tokenizer_config.json with the special tokens."""
    return llama3_tokenizer_folder(tmp_path_factory.mktemp("llama3_tokenizer"), CORPUS, SPECIALS)


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


@pytest.mark.parametrize("prefer", ["tiktoken", "json"])
def test_ids_equal_transformers(folder, reference, prefer):
    tok = load_hf_tokenizer(folder, prefer=prefer)
    assert tok.n_vocab == 320 + len(SPECIALS)
    assert tok.eos_id == reference.eos_token_id == 321 and tok.bos_id == reference.bos_token_id == 320
    merged = 0
    for text in TEXTS:
        expected = reference(text, add_special_tokens=False)["input_ids"]
        merged += len(text.encode()) - len(expected)
        assert tok.encode_with_special(text) == expected, text
        assert tok.decode(expected) == text
    assert merged > 100  # the BPE merges (and special tokens) are exercised, not only single bytes
    # ordinary encoding keeps special-token text as text, as for every tokenizer of the project
    assert tok.special_tokens["<|eot_id|>"] not in tok.encode("a<|eot_id|>b")
    assert tok.encode("plain text only") == reference("plain text only", add_special_tokens=False)["input_ids"]


def test_json_alone_and_errors(folder, tmp_path):
    only_json = tmp_path / "json_only"
    only_json.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (only_json / name).write_bytes((folder / name).read_bytes())
    assert is_hf_tokenizer_folder(only_json) and not is_hf_tokenizer_folder(tmp_path / "nothing")
    assert load_hf_tokenizer(only_json).encode_with_special(TEXTS[3]) == load_hf_tokenizer(folder).encode_with_special(TEXTS[3])

    data = json.loads((folder / "tokenizer.json").read_text())
    merges = data["model"]["merges"]
    data["model"]["merges"] = [merges[-1], *merges[:-1]]  # the last merge first: not in id order
    (only_json / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(HFTokenizerError, match="not in id order"):
        load_hf_tokenizer(only_json)

    (only_json / "tokenizer.json").unlink()
    (only_json / "tokenizer.model").write_text("not base64 at all\n")
    with pytest.raises(HFTokenizerError, match="not a tiktoken BPE file"):
        load_hf_tokenizer(only_json)


def test_byte_table_is_gpt2s():
    table = byte_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_data_tokenizer_names_a_hugging_face_folder(folder):
    from mhar_titan.data import DataConfig
    from mhar_titan.data.tokenizer import build_tokenizer, tokenizer_n_vocab

    tok = build_tokenizer(DataConfig(tokenizer=f"hf:{folder}"))
    assert tok.n_vocab == 320 + len(SPECIALS) and tok.encode("Hello world") == load_hf_tokenizer(folder).encode("Hello world")
    assert tokenizer_n_vocab(f"hf:{folder}") is None  # sized from the files only when they are read


def test_a_folder_with_only_tokenizer_model_is_exported_as_tokenizer_json(folder, tmp_path):
    """An export of a Llama-3-style tokenizer read from tokenizer.model alone writes a tokenizer.json
    that transformers encodes with the same ids (and that reads back here the same way)."""
    from mhar_titan.convert.tokenizer_files import write_tokenizer_files

    source = tmp_path / "model_only"
    (source / "original").mkdir(parents=True)
    for name in ("original/tokenizer.model", "tokenizer_config.json"):
        (source / name).write_bytes((folder / name).read_bytes())
    ours = load_hf_tokenizer(source)
    (tmp_path / "out").mkdir()
    write_tokenizer_files(ours, tmp_path / "out", 256)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (theirs.eos_token, theirs.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")
    for text in TEXTS:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode_with_special(text), text
        assert load_hf_tokenizer(tmp_path / "out").encode(text) == ours.encode(text), text


@pytest.mark.parametrize("pad", [None, "<|reserved_special_token_0|>"])
def test_an_export_names_the_pad_token_its_tokenizer_files_name(tmp_path, pad):
    """config.json's and generation_config.json's pad_token_id are the id AutoTokenizer gives the
    folder's pad token: a copied tokenizer's own pad token, else eos (what the export adds)."""
    from helpers import trained_like_debug

    from mhar_titan.convert import export_pretrained
    from mhar_titan.convert.hf_config import ConversionError
    from mhar_titan.convert.tokenizer_files import pad_token_id

    source = llama3_tokenizer_folder(tmp_path / "tok", CORPUS, SPECIALS)
    if pad is not None:
        config = json.loads((source / "tokenizer_config.json").read_text())
        (source / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": pad}))
    tokenizer = load_hf_tokenizer(source)
    export_pretrained(trained_like_debug({}, 384), tmp_path / "out", tokenizer=tokenizer)
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "out"))
    expected = tokenizer.eos_id if pad is None else tokenizer.special_tokens[pad]
    assert loaded.pad_token_id == expected
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["pad_token_id"] == expected
    # a pad token the vocabulary does not hold is refused by name
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    (tmp_path / "out" / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|no such token|>"}))
    (tmp_path / "out" / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(ConversionError, match="no such token"):
        pad_token_id(tmp_path / "out", tokenizer)
