"""Reading pretokenized directories: ``manifest.json`` and its memory-mapped token shards.

The format is written by ``python -m mhar_titan.data.pretokenize`` (see that module).
This module holds only what the loader needs at training time, so importing the
package never imports the command-line module.

Every problem with a pretokenized directory raises ``ManifestError`` naming the
path and saying to re-run ``python -m mhar_titan.data.pretokenize``.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from mhar_titan.errors import UserError

FORMAT = "mhar-titan-tokens/1"
MANIFEST = "manifest.json"
RERUN = "re-run python -m mhar_titan.data.pretokenize --files ... --out <a new folder>"


class ManifestError(UserError, ValueError):
    """A pretokenized directory that is missing, incomplete, corrupt or made with another tokenizer."""


class PretokenizedShard:
    """One token shard: row i is ``tokens[offsets[i]:offsets[i+1]]`` of a memory-mapped file.

    ``tokens``: ``n_tokens`` ids of ``dtype`` (uint16/uint32) back to back; ``offsets``: an
    int64 ``.npy`` array of length rows + 1 starting at 0 and ending at ``n_tokens``.
    """

    def __init__(self, origin: Path, tokens: Path, offsets: Path, dtype: str, n_tokens: int, name: str,
                 n_docs: int):
        self.origin, self.tokens_path, self.offsets_path = origin, tokens, offsets
        self.dtype, self.n_tokens, self.name, self.n_docs = dtype, n_tokens, name, n_docs

    def _offsets(self) -> np.ndarray:
        try:
            return np.load(self.offsets_path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ManifestError(f"cannot read the row offsets {self.offsets_path} of pretokenized shard "
                                f"{self.tokens_path}: {e}; {RERUN}") from e

    def check(self) -> None:
        """Raise ManifestError now (in the main process) if either file is missing or does not match the manifest."""
        size = self.tokens_path.stat().st_size if self.tokens_path.exists() else -1
        if size != self.n_tokens * np.dtype(self.dtype).itemsize:
            raise ManifestError(f"token file {self.tokens_path} has {size} bytes (-1 = missing), the manifest says "
                                f"{self.n_tokens} {self.dtype} tokens; {RERUN}")
        if not self.offsets_path.is_file():
            raise ManifestError(f"row offsets file {self.offsets_path} of pretokenized shard {self.tokens_path} is "
                                f"missing; {RERUN}")
        offsets = self._offsets()
        if offsets.ndim != 1 or len(offsets) != self.n_docs + 1 or offsets[0] != 0 or offsets[-1] != self.n_tokens:
            raise ManifestError(f"row offsets file {self.offsets_path} does not match the manifest ({self.n_docs} "
                                f"rows, {self.n_tokens} tokens); {RERUN}")

    def row_lengths(self) -> np.ndarray:
        """Tokens in each row (int64, shape (rows,)), without reading the tokens."""
        return np.diff(np.asarray(self._offsets(), dtype=np.int64))

    def rows(self, start: int = 0) -> Iterator[np.ndarray]:
        offsets = np.asarray(self._offsets())
        tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        for i in range(start, len(offsets) - 1):
            yield np.asarray(tokens[offsets[i]:offsets[i + 1]], dtype=np.int64)


@dataclass
class Pretokenized:
    """A loaded manifest: tokenizer identity and shards in order."""

    tokenizer: str
    n_vocab: int
    eos_id: int
    shards: list


def load_pretokenized(directory: Path) -> Pretokenized:
    """Read ``directory/manifest.json``.

    Raises ManifestError for a missing, unparsable or incomplete manifest (naming the path).
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{directory} is not a pretokenized directory: no {MANIFEST}; create it with "
                            f"python -m mhar_titan.data.pretokenize --files ... --out {directory}")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is not readable JSON ({e}): the manifest is corrupt; {RERUN}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ManifestError(f"{path}: format {got!r}, expected {FORMAT!r}; {RERUN}")
    d = Path(directory).resolve()
    try:
        shards = [PretokenizedShard(d, d / s["tokens"], d / s["offsets"], str(np.dtype(m["dtype"])),
                                    int(s["n_tokens"]), f"{d / s['tokens']} (from {s['source']})", int(s["n_docs"]))
                  for s in m["shards"]]
        return Pretokenized(str(m["tokenizer"]), int(m["n_vocab"]), int(m["eos_id"]), shards)
    except KeyError as e:
        raise ManifestError(f"{path} has no key {e}: the manifest is incomplete; {RERUN}") from e
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{path} has a malformed entry ({type(e).__name__}: {e}); {RERUN}") from e


def check_tokenizer(directory: Path, tokenizer) -> None:
    """Refuse pretokenized data made with another tokenizer than ``tokenizer`` (ManifestError)."""
    p = load_pretokenized(directory)
    if (p.tokenizer, p.n_vocab, p.eos_id) != (tokenizer.name, tokenizer.n_vocab, tokenizer.eos_id):
        raise ManifestError(
            f"pretokenized data {directory} was made with tokenizer {p.tokenizer!r} (n_vocab {p.n_vocab}, eos "
            f"{p.eos_id}) but this run uses {tokenizer.name!r} (n_vocab {tokenizer.n_vocab}, eos "
            f"{tokenizer.eos_id}); set data.tokenizer = {p.tokenizer!r} or re-run python -m "
            f"mhar_titan.data.pretokenize --tokenizer {tokenizer.name} into a new folder")
