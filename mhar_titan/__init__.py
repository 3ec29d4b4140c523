"""mhar_titan: TorchTitan-style pretraining of depth-routing transformers (baseline, AttnRes, MHAR).

Import policy (every package ``__init__`` of the project): an ``__init__`` imports nothing
heavy; the names a package offers are exported lazily through ``mhar_titan.lazy.lazy_exports``,
so importing a package, or a light module in it, never imports torch, the data stack or a
builder it does not need. ``mhar_kernels`` (a leaf that imports nothing of ours) follows the
same rule with its own module ``__getattr__``.
"""
