"""Helpers shared by the tests and their worker scripts: the repository root, run-folder readers,
tiny models for the analysis and evaluation tests, PNG checks.

Import with ``from helpers import ...`` (pytest puts tests/ on ``sys.path``; worker
scripts run from tests/ have it as their script folder).
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The repository root."""

PATIENCE_S = 900.0
"""How long a test waits for a child process, or for a file another process or thread writes,
before it calls that a hang. A guard, not a timing: the wait ends as soon as the awaited thing
happens. Measured 2026-12-01 on 2 cores at load 10: the longest test waiting on children
(`test_sigterm_on_both_launchers_checkpoints_and_relaunch_resumes`, two 2-node launches) took
146 s in all, so one child stays under 900 s at load 30 with room to spare; the processes-marked
tests passed beside two CPU-busy processes at load 23-29."""


def wait_for(predicate, what: str, timeout: float = PATIENCE_S, interval: float = 0.1, context=lambda: ""):
    """Poll ``predicate()`` until it returns something truthy and return that; AssertionError
    naming ``what`` (and ``context()``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}\n{context()}"
        time.sleep(interval)


_NO_INSTALL = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in repr(h)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p and p not in ("", ".")]
sys.path.insert(0, {folder!r})  # as `python SCRIPT` puts the script's folder first
sys.argv = [{script!r}, *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def no_install_argv(script: pathlib.Path, *args: str) -> list[str]:
    """The command that runs ``python SCRIPT ARGS`` as a machine with no install of the project would
    (the GPU machine runs the checkout as it is): this interpreter with the editable install's import
    finders dropped and the script's folder first on sys.path. Run it from an empty folder, with
    PYTHONPATH unset, so that only what the script itself puts on sys.path finds the project."""
    return [sys.executable, "-c", _NO_INSTALL.format(folder=str(script.parent), script=str(script), args=list(args))]


@contextmanager
def tmpfs(path, size, *, leave=None):
    """A real tmpfs of ``size`` (bytes, or mount's ``256k`` / ``1m``) mounted at ``path``; with
    ``leave``, filled by a file ``fill`` until the kernel answers ENOSPC, then shortened so that
    ``leave`` bytes are free (a real full disk). Unmounted at the end whatever happens; the test
    is skipped, saying why, where mounting is not allowed (it needs root with CAP_SYS_ADMIN)."""
    import pytest

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} ({done.stderr.strip() or done.returncode}): the real "
                    "filesystem tests need root with mount permission")
    try:
        if leave is not None:
            fd = os.open(path / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                written = 0
                while True:
                    try:
                        written += os.write(fd, b"\0" * (1 << 16))
                    except OSError as e:
                        assert e.errno == 28, e  # ENOSPC: the filesystem is full
                        break
                os.ftruncate(fd, max(0, written - leave))
            finally:
                os.close(fd)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def read_metrics(run_dir, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of a run folder's JSONL metrics file, in file order; [] when it does not exist.
    Safe to poll while a trainer writes the file: a last row without its newline yet (being
    written) is left out."""
    path = pathlib.Path(run_dir) / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def metric_losses(run_dir) -> list[float]:
    """The training loss of every logged step, in step order (the sinks write a NaN as "nan")."""
    rows = sorted((r for r in read_metrics(run_dir) if "loss" in r), key=lambda r: r["step"])
    return [math.nan if r["loss"] == "nan" else float(r["loss"]) for r in rows]


# -- tiny models and figures (analysis, evaluation, generation tests) ------------------------

def tiny_args(**overrides):
    """``ModelArgs`` of a 2-layer d=32 decoder at the gpt2 vocabulary (the real tokenizer fits)."""
    from mhar_titan.models import ModelArgs

    base = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50_304, max_seq_len=64)
    return ModelArgs(**{**base, **overrides})


def tiny_model(seed: int = 0, random_queries: bool = False, **overrides):
    """An initialised ``Transformer(tiny_args(**overrides))`` in eval mode; ``random_queries`` draws
    N(0, 1) pseudo-queries and key norms in [0.5, 1.5] so that routing is far from uniform, or for
    another depth connection (DenseFormer, MUDDFormer) moves every connection parameter off its
    initialisation by N(0, 0.3^2) (at its initialisation such a model is the baseline)."""
    import torch

    from mhar_titan.models import Transformer

    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    model.init_weights()
    if random_queries:
        with torch.no_grad():
            if hasattr(model.routing, "query"):
                model.routing.query.normal_()
                model.routing.key_norm.uniform_(0.5, 1.5)
            else:
                generator = torch.Generator().manual_seed(seed + 5)
                for p in model.routing.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return model.eval()


def random_tokens(batch: int = 2, length: int = 12, seed: int = 1):
    """(batch, length) int64 ids below the gpt2 vocabulary size, from a seeded generator."""
    import torch

    return torch.randint(0, 50_257, (batch, length), generator=torch.Generator().manual_seed(seed))


def read_png(path):
    """The PNG's pixels as a (height, width, 3) float array in [0, 1]."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255.0


def assert_not_blank(path) -> None:
    """The image is sizeable, has many distinct colours and is not one flat colour."""
    import numpy as np

    pixels = read_png(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20


def decode_heatmap_cell(pixels, heat, name: str, row: int, col: int) -> float:
    """The value whose colour is at the centre of cell (row, col) of heatmap panel ``name``:
    ``pixels`` from ``read_png`` of the saved figure, ``heat`` what ``plot_routing_heatmaps``
    returned (its axes give the cell positions; the colour map is inverted by nearest colour)."""
    import numpy as np

    from mhar_titan.analysis.plots import pyplot

    x, y = heat.axes[name].transData.transform((col, row))
    rgb = pixels[int(round(pixels.shape[0] - y)), int(round(x))]
    cmap = pyplot().get_cmap(heat.cmap)
    table = cmap(np.linspace(0, 1, cmap.N))[:, :3]
    return heat.vmin + int(np.argmin(((table - rgb) ** 2).sum(1))) / (cmap.N - 1) * (heat.vmax - heat.vmin)


def autograd_nodes(output) -> list:
    """Every node of the autograd graph behind the tensor `output` (each once)."""
    nodes, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo += [next_node for next_node, _ in node.next_functions]
    return nodes


def site_sources(model, tokens) -> list:
    """The sources every routing site of one forward (`hidden_states(tokens)`) routes over, in
    site order, as the model's Router hands them to an observer (`Transformer.observe_routing`)."""
    seen = []
    with model.observe_routing(lambda site, sources, router: seen.append(sources)):
        model.hidden_states(tokens)
    return seen


# -- tokenizer folders (conversion and export tests) --------------------------------------------

def llama3_tokenizer_folder(root, corpus: str, specials: list[str], vocab_size: int = 320):
    """A Llama-3-style tokenizer folder in ``root``: original/tokenizer.model (a tiktoken BPE of
    ``vocab_size`` ranks trained on ``corpus``), the tokenizer.json transformers converts it to,
    and tokenizer_config.json naming the special tokens (ids after the ranks; bos the first,
    eos the second). Needs transformers. Returns ``root``."""
    import base64
    import os

    from tiktoken._educational import bpe_train
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mhar_titan.data.hf_tokenizer import LLAMA3_PATTERN

    root = pathlib.Path(root)
    (root / "original").mkdir(parents=True)
    ranks = bpe_train(corpus, vocab_size=vocab_size, pat_str=LLAMA3_PATTERN, visualise=None)
    (root / "original" / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda x: x[1]))
    )
    ids = {text: len(ranks) + i for i, text in enumerate(specials)}
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken would otherwise cache a copy of the file
    try:
        backend = TikTokenConverter(vocab_file=str(root / "original" / "tokenizer.model"), pattern=LLAMA3_PATTERN,
                                    extra_special_tokens=ids).converted()
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    backend.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in ids.items()},
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def trained_like_debug(fields: dict, vocab_size: int):
    """A debug-flavor model (``ModelArgs`` ``fields`` on top, e.g. a ``FAMILIES`` row) in eval mode
    with every parameter moved off its init, routing ones included (so that greedy tokens are not
    one repeated id and delta gates are not 0); seeded, the same in every process."""
    import torch

    from mhar_titan.models import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_flavor("debug", vocab_size=vocab_size, **fields))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if name.startswith("routing.") else 0.05))
    return model.eval()


# -- wandb offline records -------------------------------------------------------------------

def wandb_file_records(path) -> tuple[list, bool]:
    """The protobuf ``Record``s in a wandb offline ``.wandb`` file (a LevelDB-style log) as far as
    it is written, and whether it is complete (holds the run's ``exit`` record, wandb's last).
    A record still being written (a partial block) ends the list."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = pathlib.Path(path).read_bytes()
    if data[:4] != b":W&B":
        return [], False
    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            records.append(rec)
    return records, any(r.WhichOneof("record_type") == "exit" for r in records)


def wandb_history(records) -> list[dict]:
    """The history rows (``{key: value}`` with ``_step``) of ``wandb_file_records``' records."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def read_wandb_file(path, timeout: float = PATIENCE_S) -> tuple[list[dict], dict]:
    """(history rows, run config) of a finished run's wandb offline ``.wandb`` file, once wandb's
    service has written all of it: ``run.finish()`` returns before the service has (measured
    right after ``finish()``: 1.1 kB of 2.5 kB, no history row yet), so this waits for the
    ``exit`` record, up to ``timeout`` seconds."""
    records = wait_for(lambda: (lambda got: got[1] and got[0])(wandb_file_records(path)),
                       f"wandb's service to finish writing {path}", timeout)
    config = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            update = rec.run.config.update if kind == "run" else rec.config.update
            for c in update:
                value = json.loads(c.value_json)
                if isinstance(value, dict) and isinstance(config.get(c.key), dict):
                    value = {**config[c.key], **value}  # wandb updates its internal "_wandb" key in parts
                config[c.key] = value
    return wandb_history(records), config


def assert_config_refused_in_one_line(path, needle: str, tmp_path, capsys, match: str | None = None) -> None:
    """The job config at ``path`` is refused naming ``needle``: `load_config` raises a one-line
    ConfigError (matching ``match`` where given), and `train.main` exits 2 with that one line on
    stderr, no traceback, no run folder and no process group."""
    import pytest
    import torch.distributed as dist

    from mhar_titan.config import ConfigError, load_config
    from mhar_titan.train import main

    with pytest.raises(ConfigError, match=match) as err:
        load_config(str(path))
    assert needle in str(err.value) and "\n" not in str(err.value)
    runs = tmp_path / "runs"
    assert main(["--config", str(path), f"--job.dump_folder={runs}", "--model.vocab_size=384"]) == 2
    out = capsys.readouterr().err
    assert needle in out and "Traceback" not in out and len(out.strip().splitlines()) == 1
    assert not runs.exists() and not dist.is_initialized()  # no run folder, no process group, no model
