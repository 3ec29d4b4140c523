"""Checkpoint conversion: Hugging Face Llama folders in and out, and delta-MHAR conversion."""
from .hf_config import ConversionError, args_from_hf_config, hf_config_from_args
from .hf_llama import empty_model, export_hf, hf_args, import_hf, is_hf_folder, load_hf_weights

__all__ = [
    "ConversionError", "args_from_hf_config", "hf_config_from_args",
    "empty_model", "export_hf", "hf_args", "import_hf", "is_hf_folder", "load_hf_weights",
]
