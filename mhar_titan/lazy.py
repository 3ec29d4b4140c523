"""Lazy re-exports: the one import policy of the project's package ``__init__`` files (imports nothing of ours).

A package ``__init__`` imports nothing heavy itself: it lists ``{name: module}`` and sets
``__getattr__ = lazy_exports(__name__, exports)``; ``from package import name`` then imports only
the module that defines ``name``, on first use. A module is a submodule name (``"loader"``) or an
absolute one (``"mhar_titan.config.data"``: a name the package re-exports from its owner).
"""
from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that resolves ``exports`` (name -> submodule).

    Raises (from the returned function): AttributeError for a name not in ``exports``."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = exports[name]
        return getattr(importlib.import_module(module if "." in module else f"{package}.{module}"), name)
    return __getattr__
