"""mhar_titan: TorchTitan-style pretraining of depth-routing transformers (baseline, AttnRes, MHAR).

Import policy (every package ``__init__`` of the project): an ``__init__`` imports nothing
heavy; the names a package offers are exported lazily through ``mhar_titan.lazy.lazy_exports``,
so importing a package, or a light module in it, never imports torch, the data stack or a
builder it does not need. ``mhar_kernels`` (a leaf that imports nothing of ours) follows the
same rule with its own module ``__getattr__``.

The public API (lazy, as above): the model (``Transformer``, ``ModelArgs``, ``FLAVORS`` shapes,
``FAMILIES`` residual paths); the config (``JobConfig``, ``load_config(file, overrides)``);
training (``run_training(cfg)``: check, build, train, close; ``Trainer``, the loop itself);
using a run (``load_run(folder)``: model and tokenizer of a checkpoint; ``generate_batch``:
KV-cache decoding; ``mhar_titan.generate`` is the sampling command's module, so the name is
not an export).
"""
from mhar_titan.lazy import lazy_exports

_EXPORTS = {
    "Transformer": "models", "ModelArgs": "models", "FLAVORS": "models", "FAMILIES": "models",
    "JobConfig": "config", "load_config": "config",
    "Trainer": "train", "run_training": "train",
    "load_run": "mhar_titan.eval.load", "generate_batch": "mhar_titan.eval.generation",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
