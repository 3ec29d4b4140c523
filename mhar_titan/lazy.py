"""Lazy re-exports for packages whose submodules import heavy libraries (imports nothing of ours).

A package lists ``{name: submodule}`` and sets ``__getattr__ = lazy_exports(__name__, exports)``:
``from package import name`` then imports only the submodule that defines ``name``, on first use.
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
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
    return __getattr__
