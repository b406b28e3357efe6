"""``core_v2.Config``: what an unmanaged script says about its run (Determined's fields),
and the deprecated ``defaults=``/``unmanaged=`` spellings merged into it."""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from typing import Any

from det_tasks import cluster_info

__all__ = ["Config", "DefaultConfig", "UnmanagedConfig", "merge_config", "raw_config"]

# Determined's searcher for an unmanaged run: one trial, a long length nobody trains to.
DEFAULT_SEARCHER = {"name": "single", "metric": "unmanaged", "max_length": 100000000}


@dataclasses.dataclass
class Config:
    """An unmanaged run's experiment: its ``name`` (default ``unmanaged-<8 hex>``),
    ``hparams``, ``data``, ``description``, ``labels``, ``searcher`` (its metric orders the
    trials), and ``external_experiment_id``/``external_trial_id`` to rejoin an earlier run.
    Ignored when the script runs as a launched trial (then its experiment's config rules).
    ``workspace`` and ``project`` are kept in the stored config (MLflow has no RBAC
    scopes)."""

    name: str | None = None
    hparams: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    description: str | None = None
    labels: list[str] | None = None
    workspace: str | None = None
    project: str | None = None
    checkpoint_storage: str | dict[str, Any] | None = None
    searcher: dict[str, Any] | None = None
    external_experiment_id: str | None = None
    external_trial_id: str | None = None


class DefaultConfig(Config):
    """Deprecated in Determined: use ``Config``."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn(
            "'DefaultConfig' is deprecated: use core_v2.Config", FutureWarning, stacklevel=2
        )
        super().__init__(**kwargs)


class UnmanagedConfig(Config):
    """Deprecated in Determined: use ``Config``."""

    def __init__(self, **kwargs: Any) -> None:
        warnings.warn(
            "'UnmanagedConfig' is deprecated: use core_v2.Config", FutureWarning, stacklevel=2
        )
        super().__init__(**kwargs)


def merge_config(
    config: Config | None, defaults: Config | None, unmanaged: Config | None
) -> Config | None:
    """The one config ``init`` uses: ``config`` if given, else ``defaults`` with
    ``unmanaged``'s placement and external ids filled in (Determined's rule); None only on
    a launched trial, which needs none."""
    if defaults is not None or unmanaged is not None:
        warnings.warn(
            "core_v2.init(defaults=, unmanaged=) is deprecated: pass config=core_v2.Config()",
            FutureWarning,
            stacklevel=3,
        )
    if config is not None:
        return config
    if defaults is None:
        if cluster_info.get_cluster_info() is None:
            raise ValueError(
                "core_v2.init(): either specify `defaults` or `config` (core_v2.Config(name="
                "...)), or run as a launched experiment (det-tasks run / det experiment create)"
            )
        return None
    if unmanaged is not None:
        for field in ("project", "workspace", "external_experiment_id", "external_trial_id"):
            setattr(defaults, field, getattr(defaults, field) or getattr(unmanaged, field))
    return defaults


def raw_config(config: Config) -> dict[str, Any]:
    """The experiment config an unmanaged run is recorded with (what the trial's
    ``get_cluster_info().trial.config`` returns)."""
    raw: dict[str, Any] = {
        "name": config.name or f"unmanaged-{uuid.uuid4().hex[:8]}",
        "searcher": dict(config.searcher or DEFAULT_SEARCHER),
        "entrypoint": "unmanaged",
    }
    for field in ("data", "description", "labels", "workspace", "project"):
        value = getattr(config, field)
        if value is not None:
            raw[field] = value
    if isinstance(config.checkpoint_storage, dict):
        raw["checkpoint_storage"] = config.checkpoint_storage
    return raw
