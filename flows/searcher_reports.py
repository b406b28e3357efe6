"""What the experiment flow tells its searcher and keeps of it: the searcher metric of a
validation, which value is better, and the searcher's state on the parent run."""

from __future__ import annotations

import math
from typing import Any

from det_tasks.config import ExperimentConfig
from det_tasks.searchers.base import Searcher
from registry.runs.searcher_state import save_searcher_state
from registry.runs.tracking import ExperimentRuns

__all__ = ["better", "persist", "searcher_metric"]


def searcher_metric(validation: dict[str, Any] | None, config: ExperimentConfig) -> float:
    metrics = validation or {}
    name = config.searcher.metric
    if name not in metrics:
        raise RuntimeError(
            f"searcher.metric {name!r} is not among the validation metrics {sorted(metrics)}"
        )
    return float(metrics[name])


def better(value: float, than: float, cfg: ExperimentConfig) -> bool:
    if math.isnan(than):
        return True
    return value < than if cfg.searcher.smaller_is_better else value > than


def persist(searcher: Searcher, runs: ExperimentRuns) -> None:
    """The searcher's state on the parent run, whole at any size (a re-run or an activated
    experiment continues from it)."""
    save_searcher_state(runs.client, runs.parent_run_id, searcher.state())
