"""Checkpoint conversion: Hugging Face Llama folders in and out, and delta-MHAR conversion.

The names below are exported lazily (`mhar_titan.lazy`): importing the package imports no torch.
"""
from __future__ import annotations

from mhar_titan.lazy import lazy_exports

_EXPORTS = {
    "ConversionError": "hf_config", "args_from_hf_config": "hf_config", "hf_config_from_args": "hf_config",
    "export_pretrained": "folders", "load_pretrained": "folders", "load_pretrained_weights": "folders",
    "empty_model": "hf_llama", "export_hf": "hf_llama", "hf_args": "hf_llama", "import_hf": "hf_llama",
    "is_hf_folder": "hf_llama", "load_hf_weights": "hf_llama", "export_mhar": "mhar_format", "load_mhar": "mhar_format",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
