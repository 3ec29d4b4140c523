"""Checkpoints of the whole train state with DCP, and exact resume.

==================  ============================================================
``layout``          ``step-N`` folders and the ``complete.json`` marker
``find``            which checkpoint a path names (``find_checkpoint``), a run's ``config.toml``
``fingerprint``     what must match between a checkpoint and the resuming run
``checks``          key and shape checks, ``load_step`` ordering
``items``           non-tensor items: safe encoding, RNG states, export casting
``guards``          checks around a save: non-finite state, free space, a failed write
``manager``         ``CheckpointManager``: save, retention, async, load
==================  ============================================================

The names below are exported lazily (``mhar_titan.lazy``), so importing the package does not
import DCP; ``CheckpointConfig`` and the checkpoint errors are owned by the job config
(``mhar_titan.config.checkpoint``), which raises them when it validates ``[checkpoint]``.
"""
from __future__ import annotations

from mhar_titan.lazy import lazy_exports

_SECTION = "mhar_titan.config.checkpoint"  # the [checkpoint] section and the checkpoint errors
_EXPORTS = {
    "ASYNC_MODES": _SECTION, "COMPONENTS": _SECTION, "EXPORT_DTYPES": _SECTION, "CheckpointConfig": _SECTION,
    "CheckpointError": _SECTION, "CheckpointMismatchError": _SECTION,
    "MARKER": "layout", "is_complete": "layout", "read_marker": "layout", "step_folders": "layout",
    "find_checkpoint": "find", "read_run_config": "find",
    "LEGACY_MODEL_DEFAULTS": "fingerprint", "checkpoint_fingerprint": "fingerprint",
    "CheckpointManager": "manager", "refuse_optimizer_switch": "manager", "CheckpointSaveError": "guards",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
