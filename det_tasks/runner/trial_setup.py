"""What building one trial needs, whoever builds it: ``det-tasks run`` (runner.in_process)
trains it to the end, a warm worker's held trial (runner.held) segment by segment.

Both read the config the same way, get the same platform services (MLflow + S3 when
MLFLOW_TRACKING_URI is set) or local checkpoint store, and count lengths by the same rule,
so a held trial's weights equal ``det-tasks run``'s.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Any

from det_tasks import plugins
from det_tasks.checkpoints.store import CheckpointStore, LocalDirectoryStore
from det_tasks.config import ExperimentConfig, Length, sample_hparams
from det_tasks.config.entered import enter_file
from det_tasks.config.storage_paths import check_checkpoint_storage
from det_tasks.errors import ConfigError
from det_tasks.pytorch import Batch, TrainUnit
from det_tasks.pytorch.harness import length_to_unit, store_from_config

__all__ = [
    "checkpoint_store_for",
    "fit_periods",
    "load_raw_config",
    "platform_services",
    "resolved_model_dir",
    "train_unit",
    "trial_hparams",
]


def resolved_model_dir(model_dir: Path) -> Path:
    """The model directory, absolute (the trial's code runs there: runner.workdir), or a
    ConfigError naming it when it is missing."""
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    return model_dir.resolve()


def trial_hparams(config: ExperimentConfig, given: dict[str, Any] | None) -> dict[str, Any]:
    """``given``, or (None) the config's hyperparameters sampled with its experiment seed."""
    if given is not None:
        return given
    return sample_hparams(
        config.hyperparameters, random.Random(config.reproducibility.experiment_seed)
    )


def load_raw_config(
    path: Path, overrides: list[str] | None
) -> tuple[dict[str, Any], ExperimentConfig]:
    """The raw mapping (what get_experiment_config() returns) and its validated form, as
    this process entered them (det_tasks.config.entered: once per file and overrides)."""
    entered = enter_file(path, overrides)
    return entered.raw, entered.config


def platform_services(
    raw: dict[str, Any],
    config: ExperimentConfig,
    hparams: dict[str, Any],
    model_dir: Path,
    config_path: Path,
    checkpoint_dir: str | Path | None,
    trial_id: str = "1",
    experiment_run_key: str | None = None,
) -> Any:
    """A context manager giving MLflow + S3 services (a ``RunServices``) when
    MLFLOW_TRACKING_URI is set and no local checkpoint dir is forced; else giving None."""
    if checkpoint_dir is not None or not os.environ.get("MLFLOW_TRACKING_URI"):
        return contextlib.nullcontext(None)
    factory = plugins.load_one("det_tasks.run_services", "mlflow")
    if factory is None:
        raise ConfigError(
            "MLFLOW_TRACKING_URI is set but the registry package is not installed: "
            "pip install -e '.[platform]', or unset MLFLOW_TRACKING_URI to train locally"
        )
    return factory(
        raw,
        hparams,
        model_dir=model_dir.resolve(),
        experiment_name=config.name or config_path.stem,
        seed=config.reproducibility.experiment_seed,
        trial_id=trial_id,
        experiment_run_key=experiment_run_key,
    )


def checkpoint_store_for(
    services: Any,
    raw: dict[str, Any],
    checkpoint_dir: str | Path | None,
    config: ExperimentConfig,
) -> CheckpointStore:
    """The platform services' store (S3 + MLflow) when there are services; else the local
    one: ``checkpoint_dir`` if given, else the config's checkpoint_storage (checked before
    the first batch)."""
    if services is not None:
        return services.checkpoint_store  # type: ignore[no-any-return]
    if checkpoint_dir is not None:
        return LocalDirectoryStore(checkpoint_dir)
    check_checkpoint_storage(config, "checkpoint_storage")
    return store_from_config(raw)


def train_unit(config: ExperimentConfig, length: Length | None, gbs: Any) -> TrainUnit | None:
    """A config length (None: none) as the Batch or Epoch the loop counts, with the config's
    records_per_epoch (det_tasks.config.lengths)."""
    if length is None:
        return None
    return length_to_unit(length, gbs if isinstance(gbs, int) else None, config.records_per_epoch)


def fit_periods(config: ExperimentConfig, hparams: dict[str, Any]) -> dict[str, Any]:
    """``Trainer.fit``'s arguments that the config decides, besides the length: validation
    and checkpoint periods, reporting every ``scheduling_unit`` batches (as Determined's
    harness did), the checkpoint policy and the initial validation."""
    gbs = hparams.get("global_batch_size")
    return {
        "validation_period": train_unit(config, config.min_validation_period, gbs),
        "checkpoint_period": train_unit(config, config.min_checkpoint_period, gbs),
        "reporting_period": Batch(config.scheduling_unit),
        "checkpoint_policy": config.checkpoint_policy,
        "step_zero_validation": config.perform_initial_validation,
    }
