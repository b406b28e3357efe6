"""Warm start: ``searcher.source_checkpoint_uuid`` / ``source_trial_id`` initialise a new
trial from a checkpoint, as Determined does (models, optimizers, schedulers, RNG and
callbacks are restored; the new trial's progress starts at batch 0). A trial id means that
trial's most recent checkpoint; a uuid is looked up in this run's checkpoint store, then in
the registry (MLflow) when one is configured. Both given: the uuid wins, as in Determined.
"""

from __future__ import annotations

import os
from typing import Any

from det_tasks import plugins
from det_tasks.errors import CheckpointError, ConfigError, DetTasksError

__all__ = ["warm_start_reference"]


def warm_start_reference(conf: dict[str, Any], store: Any) -> str | None:
    """The checkpoint reference the config's searcher asks to warm-start from, if any."""
    searcher = conf.get("searcher") or {}
    uuid = searcher.get("source_checkpoint_uuid")
    trial_id = searcher.get("source_trial_id")
    if uuid:
        return _by_uuid(str(uuid), store)
    if trial_id is not None:
        return _by_trial(trial_id)
    return None


def _registry() -> Any:
    """registry.experiments.view.resolve_trial_checkpoint, when the platform is installed."""
    found = plugins.load_one("det_tasks.trial_resolvers", "mlflow")
    return found if found is not None and os.environ.get("MLFLOW_TRACKING_URI") else None


def _by_uuid(uuid: str, store: Any) -> str:
    try:
        with store.restore(uuid):
            return uuid
    except CheckpointError:
        pass
    resolver = _registry()
    if resolver is None:
        raise ConfigError(
            f"searcher.source_checkpoint_uuid = {uuid!r}: no such checkpoint in this trial's "
            "checkpoint storage, and no MLflow registry is configured to look further "
            "(set MLFLOW_TRACKING_URI, or point checkpoint_storage at where it lives)"
        )
    try:
        return str(resolver(None, checkpoint_uuid=uuid))
    except DetTasksError as err:
        raise ConfigError(f"searcher.source_checkpoint_uuid = {uuid!r}: {err}") from None


def _by_trial(trial_id: Any) -> str:
    resolver = _registry()
    if resolver is None:
        raise ConfigError(
            f"searcher.source_trial_id = {trial_id!r} needs the MLflow registry "
            "(MLFLOW_TRACKING_URI) to find that trial's latest checkpoint; or give "
            "searcher.source_checkpoint_uuid instead"
        )
    try:
        return str(resolver(trial_id, latest=True))
    except DetTasksError as err:
        raise ConfigError(f"searcher.source_trial_id = {trial_id!r}: {err}") from None
