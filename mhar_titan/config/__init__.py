"""The job configuration: schema (``sections``) and TOML/CLI parser and writer (``parser``).

Importing this package imports no torch, data stack or model code, so tools that only
read or write configs start without them.
"""
from mhar_titan.config.parser import ConfigError, ConfigFileNotFoundError, load_config, to_toml, validate
from mhar_titan.config.sections import (NO_DECAY_GROUPS, PARAM_GROUPS, SECTIONS, ActivationCheckpoint, Compile,
                                        Debug, Job, JobConfig, LRScheduler, Metrics, Model, Optimizer, Parallelism,
                                        Profiling, Training, Validation)

__all__ = [
    "NO_DECAY_GROUPS", "PARAM_GROUPS", "SECTIONS", "ActivationCheckpoint", "Compile", "ConfigError",
    "ConfigFileNotFoundError", "Debug", "Job", "JobConfig", "LRScheduler", "Metrics", "Model", "Optimizer",
    "Parallelism", "Profiling", "Training", "Validation", "load_config", "to_toml", "validate",
]
