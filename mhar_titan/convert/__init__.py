"""Checkpoint conversion: Hugging Face Llama folders in and out, and delta-MHAR conversion."""
from .hf_config import ConversionError, args_from_hf_config, hf_config_from_args
from .folders import export_pretrained, load_pretrained, load_pretrained_weights
from .hf_llama import empty_model, export_hf, hf_args, import_hf, is_hf_folder, load_hf_weights
from .mhar_format import export_mhar, load_mhar

__all__ = [
    "ConversionError", "args_from_hf_config", "hf_config_from_args",
    "empty_model", "export_hf", "hf_args", "import_hf", "is_hf_folder", "load_hf_weights",
    "export_pretrained", "load_pretrained", "load_pretrained_weights", "export_mhar", "load_mhar",
]
