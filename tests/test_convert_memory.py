"""Peak memory of the import command (issue 14, acceptance 5): the weights are streamed shard
by shard, so a subprocess importing a 2-shard checkpoint never holds two copies of them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import PATIENCE_S

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc/self/status", allow_module_level=True)

safetensors_torch = pytest.importorskip("safetensors.torch")

DIM, LAYERS, FFN, VOCAB = 1024, 8, 4096, 1024
MARGIN_MB = 128
"""Allowed on top of weights + largest shard: the tensor being copied plus what the C allocator
keeps of freed blocks. Measured growth: weights + 126 MB with the pread reader (safetensors >= 0.7),
weights + one shard + 105 MB with a memory-mapped shard."""

MEASURE = """
import sys
from mhar_titan.convert.__main__ import main

def status_kb(field):  # this process's own counters (ru_maxrss would include the parent's before exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

base = status_kb("VmRSS")
assert main(["import", sys.argv[1], sys.argv[2]]) == 0
print(base, status_kb("VmHWM"))
"""


def write_llama_shards(folder) -> list[int]:
    """A Llama folder of 2 shards (>= 256 MB each, fp32, tied embeddings); returns shard sizes in bytes."""
    folder.mkdir()
    config = dict(model_type="llama", hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=FFN, vocab_size=VOCAB, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=128)
    (folder / "config.json").write_text(json.dumps(config))
    weight_map, sizes = {}, []
    for shard, layers in enumerate([range(0, LAYERS // 2), range(LAYERS // 2, LAYERS)]):
        tensors = {"model.embed_tokens.weight" if shard == 0 else "model.norm.weight":
                   torch.randn(VOCAB, DIM) if shard == 0 else torch.ones(DIM)}
        for i in layers:
            p = f"model.layers.{i}."
            tensors.update({p + f"self_attn.{n}_proj.weight": torch.randn(DIM, DIM) for n in "qkvo"})
            tensors.update({p + f"mlp.{n}_proj.weight": torch.randn(FFN, DIM) for n in ("gate", "up")})
            tensors[p + "mlp.down_proj.weight"] = torch.randn(DIM, FFN)
            tensors.update({p + n: torch.ones(DIM) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")})
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        safetensors_torch.save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        sizes.append((folder / name).stat().st_size)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


def test_import_peak_memory_is_weights_plus_one_shard(tmp_path):
    sizes = write_llama_shards(tmp_path / "hf")
    assert min(sizes) >= 256 * 2**20
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "hf"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    base_kb, peak_kb = (int(v) for v in done.stdout.split()[-2:])
    weights_mb = sum(sizes) / 2**20  # header bytes are negligible
    grown_mb = (peak_kb - base_kb) / 1024
    bound_mb = weights_mb + max(sizes) / 2**20 + MARGIN_MB
    print(f"weights {weights_mb:.0f} MB, largest shard {max(sizes) / 2**20:.0f} MB, "
          f"peak RSS {peak_kb / 1024:.0f} MB = {base_kb / 1024:.0f} MB after imports + {grown_mb:.0f} MB")
    assert grown_mb < bound_mb
    assert (tmp_path / "out" / ".metadata").is_file()
