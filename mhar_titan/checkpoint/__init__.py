"""Checkpoints of the whole train state with DCP, and exact resume.

==================  ============================================================
``config``          ``[checkpoint]`` settings, ``CheckpointError`` (no torch import)
``layout``          ``step-N`` folders and the ``complete.json`` marker
``fingerprint``     what must match between a checkpoint and the resuming run
``checks``          key and shape checks, ``load_step`` ordering
``items``           non-tensor items: safe encoding, RNG states, export casting
``guards``          checks around a save: non-finite state, free space, a failed write
``manager``         ``CheckpointManager``: save, retention, async, load
==================  ============================================================

The names below are exported lazily, so ``from mhar_titan.checkpoint import
CheckpointConfig`` (the job config parser does) does not import DCP.
"""
from __future__ import annotations

from mhar_titan.lazy import lazy_exports

_EXPORTS = {
    "ASYNC_MODES": "config", "COMPONENTS": "config", "EXPORT_DTYPES": "config", "CheckpointConfig": "config",
    "CheckpointError": "config", "CheckpointMismatchError": "config",
    "MARKER": "layout", "is_complete": "layout", "read_marker": "layout", "step_folders": "layout",
    "LEGACY_MODEL_DEFAULTS": "fingerprint", "RESUMABLE_MODEL_FIELDS": "fingerprint", "checkpoint_fingerprint": "fingerprint",
    "CheckpointManager": "manager", "CheckpointSaveError": "guards",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
