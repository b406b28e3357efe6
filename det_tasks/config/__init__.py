"""Experiment configuration: Determined's YAML as frozen, typed objects."""

from det_tasks.config.experiment import (
    DirectoryStorage,
    ExperimentConfig,
    Length,
    S3Storage,
    SearcherConfig,
    SharedFSStorage,
)
from det_tasks.config.hyperparameters import flatten_hparams, grid_values, sample_hparams
from det_tasks.config.loader import apply_overrides, load_config, parse_config

__all__ = [
    "DirectoryStorage",
    "ExperimentConfig",
    "Length",
    "S3Storage",
    "SearcherConfig",
    "SharedFSStorage",
    "apply_overrides",
    "flatten_hparams",
    "grid_values",
    "load_config",
    "parse_config",
    "sample_hparams",
]
