"""The experiment flow run's table of trials (a Prefect table artifact), republished as
trials finish segments, so the UI and ``--watch`` users see results without reading logs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

from prefect.artifacts import create_table_artifact

__all__ = ["TrialTable"]


@dataclasses.dataclass
class _Row:
    trial_id: int
    hparams: dict[str, Any]
    mlflow: str
    state: str = "QUEUED"
    batches: int = 0
    metric: float | None = None
    best_metric: float | None = None
    best_checkpoint: str | None = None


class TrialTable:
    """One row per trial: id, hyperparameters, state, searcher metric (latest and best),
    batches trained, best checkpoint URI and the MLflow run's link."""

    def __init__(
        self,
        experiment: str,
        metric: str,
        smaller_is_better: bool,
        mlflow_link: Callable[[str], str],
    ) -> None:
        self.key = _artifact_key(f"{experiment}-trials")
        self.experiment = experiment
        self.metric = metric
        self.smaller_is_better = smaller_is_better
        self.mlflow_link = mlflow_link
        self.rows: dict[int, _Row] = {}

    def add(self, trial_id: int, hparams: dict[str, Any], mlflow_run_id: str) -> None:
        if trial_id not in self.rows:
            self.rows[trial_id] = _Row(trial_id, hparams, self.mlflow_link(mlflow_run_id))

    def set_state(self, trial_id: int, state: str) -> None:
        self.rows[trial_id].state = state

    def segment_done(
        self, trial_id: int, batches: int, metric: float, checkpoint: str | None
    ) -> None:
        row = self.rows[trial_id]
        row.batches, row.metric = batches, metric
        if row.best_metric is None or self._better(metric, row.best_metric):
            row.best_metric, row.best_checkpoint = metric, checkpoint or row.best_checkpoint

    def publish(self) -> None:
        """A new version of the artifact (same key) with every row as it is now."""
        table = [
            {
                "trial": row.trial_id,
                "hparams": json.dumps(row.hparams, sort_keys=True, default=str),
                "state": row.state,
                self.metric: row.metric,
                f"best {self.metric}": row.best_metric,
                "batches": row.batches,
                "best checkpoint": row.best_checkpoint,
                "mlflow": row.mlflow,
            }
            for row in sorted(self.rows.values(), key=lambda r: r.trial_id)
        ]
        create_table_artifact(
            table=table,
            key=self.key,
            description=f"Trials of experiment {self.experiment!r} (searcher metric "
            f"{self.metric}, {'smaller' if self.smaller_is_better else 'larger'} is better)",
        )

    def _better(self, value: float, than: float) -> bool:
        if math.isnan(than):
            return True
        return value < than if self.smaller_is_better else value > than


def _artifact_key(text: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "trials"
