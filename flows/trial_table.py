"""The experiment flow run's table of trials and its progress, as two Prefect artifacts
created once and updated in place as trials finish segments, so the UI and ``--watch``
users see results without reading logs (a ``create_*_artifact`` call per update would store
a new copy of the whole table each time: quadratic in the number of trials).

Each row's "best" is the trial's best validation of the searcher metric over its whole
history, by the same rule as the parent run's ``det.best.*`` tags and ``det-tasks
experiment describe`` (registry.experiment_view): while a trial runs the table knows only
the validations that end its segments; once its MLflow run is complete (the trial
COMPLETED, or STOPPED when the search ended) the row is settled from MLflow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from det_tasks.config.hyperparameters import flatten_hparams
from registry.experiment_view import TrialBest, best_point, trial_best
from registry.settings import RegistrySettings
from registry.tracking import client_for
from registry.trial_states import CANCELED, COMPLETED, ERROR, STOPPED

__all__ = ["FINISHED_STATES", "PRUNED", "SETTLED_STATES", "TrialTable", "significant"]

PRUNED = "PRUNED"  # ended early by an optuna searcher's pruner (its run: FINISHED, det.state)

# States whose trial run has been released, so its MLflow history is complete.
SETTLED_STATES = frozenset({COMPLETED, STOPPED, PRUNED})
# States that count as done for the progress artifact.
FINISHED_STATES = SETTLED_STATES | {CANCELED, ERROR, "INVALID_HP"}
DIGITS = 4  # significant digits of every number the table shows
# How often publish_soon sends the table at most (see publish_interval_s).
MIN_PUBLISH_INTERVAL_S = 2.0
PUBLISH_INTERVAL_PER_TRIAL_S = 0.01

BestOf = Callable[[str], TrialBest]  # MLflow run id -> the trial's best


@dataclasses.dataclass
class _Row:
    trial_id: int
    hparams: dict[str, Any]
    mlflow_run_id: str
    mlflow: str
    state: str = "QUEUED"
    batches: int = 0
    metric: float | None = None  # at the end of the latest segment
    # (batch, value, checkpoint at that batch) of each segment-ending validation seen.
    seen: list[tuple[int, float, str | None]] = dataclasses.field(default_factory=list)
    settled: TrialBest | None = None  # from the trial's complete MLflow history

    def best(self, smaller_is_better: bool) -> TrialBest:
        if self.settled is not None and self.settled.value is not None:
            return self.settled
        point = best_point(((b, v) for b, v, _ in self.seen), smaller_is_better)
        if point is None:
            return TrialBest(None, None, None)
        checkpoint = next((c for b, _, c in self.seen if b == point[0] and c), None)
        return TrialBest(point[1], point[0], checkpoint)


class TrialTable:
    """One row per trial, best first: id, state, batches trained, the searcher metric's
    best (and the batch it was reached at) and latest value, one column per
    hyperparameter, the best checkpoint's URI and the MLflow run's link."""

    def __init__(
        self,
        experiment: str,
        metric: str,
        smaller_is_better: bool,
        mlflow_link: Callable[[str], str],
        *,
        total_trials: int | None = None,
        best_of: BestOf | None = None,
    ) -> None:
        """``total_trials``: how many the searcher will run, for the progress artifact
        (default: the trials known so far). ``best_of``: a trial's best from its finished
        MLflow run (default: read from the MLflow server in MLFLOW_TRACKING_URI)."""
        self.key = _artifact_key(f"{experiment}-trials")
        self.progress_key = _artifact_key(f"{experiment}-progress")
        self.experiment = experiment
        self.metric = metric
        self.smaller_is_better = smaller_is_better
        self.mlflow_link = mlflow_link
        self.total_trials = total_trials
        self._best_of = best_of
        self.rows: dict[int, _Row] = {}
        self._table_id: UUID | None = None
        self._progress_id: UUID | None = None
        self._published_at = -math.inf  # time.monotonic() of the last publish
        self._stale = False  # changed since then (publish_soon held it back)

    def add(self, trial_id: int, hparams: dict[str, Any], mlflow_run_id: str) -> None:
        if trial_id not in self.rows:
            link = self.mlflow_link(mlflow_run_id)
            self.rows[trial_id] = _Row(trial_id, hparams, mlflow_run_id, link)

    def set_state(self, trial_id: int, state: str) -> None:
        self.rows[trial_id].state = state

    def segment_done(
        self, trial_id: int, batches: int, metric: float, checkpoint: str | None
    ) -> None:
        """The validation that ended a segment (at ``batches``) and its checkpoint."""
        row = self.rows[trial_id]
        row.batches, row.metric = batches, metric
        row.seen.append((batches, metric, checkpoint))

    # ---- what the table says ------------------------------------------------------------
    def settle(self) -> None:
        """Read the complete MLflow history of each trial that reached a settled state
        since the last call (once per trial)."""
        for row in self.rows.values():
            if row.state in SETTLED_STATES and row.settled is None:
                best_of = self._lookup()
                if best_of is not None:
                    row.settled = best_of(row.mlflow_run_id)

    def best(self) -> dict[str, Any] | None:
        """The best trial as the flow's summary reports it (same trial, value, batch and
        checkpoint as the table's first row)."""
        ranked = self._ranked()
        if not ranked or ranked[0][1].value is None:
            return None
        row, best = ranked[0]
        return {
            "trial_id": row.trial_id,
            "metric": best.value,
            "step": best.step,
            "hparams": row.hparams,
            "checkpoint": best.checkpoint,
            "batches_trained": row.batches,
        }

    def table(self) -> list[dict[str, Any]]:
        """The rows as published, best first, numbers to ``DIGITS`` significant digits."""
        fixed = ["trial", "state", "batches", f"best {self.metric}", "best at batch"]
        fixed += [self.metric, "best checkpoint", "mlflow"]
        rows = []
        for row, best in self._ranked():
            hparams = {
                (name if name not in fixed else f"hp.{name}"): significant(value)
                for name, value in flatten_hparams(row.hparams).items()
            }
            rows.append(
                {
                    "trial": row.trial_id,
                    "state": row.state,
                    "batches": row.batches,
                    f"best {self.metric}": significant(best.value),
                    "best at batch": best.step,
                    self.metric: significant(row.metric),
                    **hparams,
                    "best checkpoint": best.checkpoint,
                    "mlflow": row.mlflow,
                }
            )
        return rows

    def progress(self) -> tuple[int, int]:
        """(trials finished, trials in all)."""
        done = sum(row.state in FINISHED_STATES for row in self.rows.values())
        return done, max(self.total_trials or 0, len(self.rows))

    # ---- Prefect ------------------------------------------------------------------------
    def publish_soon(self) -> None:
        """Publish now unless the last publish was under ``publish_interval_s`` ago; then
        ``publish_if_stale`` publishes once it is due. Every publish sends the whole table,
        so one per trial end made an experiment's bookkeeping grow with the square of its
        trials (1,024 trials: a 100 KB table written 2,000 times)."""
        if time.monotonic() - self._published_at >= self.publish_interval_s:
            self.publish()
        else:
            self._stale = True

    def publish_if_stale(self) -> None:
        """Publish what ``publish_soon`` held back, once it is due."""
        if self._stale:
            self.publish_soon()

    @property
    def publish_interval_s(self) -> float:
        """2 s, or 10 ms a trial for large tables (10 s at 1,000 trials): what the tables
        sent cost stays in proportion to the experiment's length, not its square."""
        return max(MIN_PUBLISH_INTERVAL_S, PUBLISH_INTERVAL_PER_TRIAL_S * len(self.rows))

    def publish(self) -> None:
        """The table and progress artifacts as they are now: created by the first call
        (in the flow run), updated in place by later ones."""
        self._published_at, self._stale = time.monotonic(), False
        self.settle()
        rows = self.table()
        if self._table_id is None:
            self._table_id = _created(
                create_table_artifact(table=rows, key=self.key, description=self._description())
            )
        else:
            get_client(sync_client=True).update_artifact(
                self._table_id, ArtifactUpdate(data=json.dumps(rows, default=str))
            )
        done, total = self.progress()
        percent = 100.0 * done / total if total else 0.0
        text = f"{done} of {total} trials of experiment {self.experiment!r} finished"
        if self._progress_id is None:
            self._progress_id = _created(
                create_progress_artifact(percent, key=self.progress_key, description=text)
            )
        else:
            update_progress_artifact(self._progress_id, percent, description=text)

    def _ranked(self) -> list[tuple[_Row, TrialBest]]:
        sign = 1.0 if self.smaller_is_better else -1.0
        scored = [(row, row.best(self.smaller_is_better)) for row in self.rows.values()]

        def order(item: tuple[_Row, TrialBest]) -> tuple[int, float, int, int]:
            row, best = item
            if best.value is None:
                return (1, 0.0, 0, row.trial_id)
            return (0, sign * best.value, best.step or 0, row.trial_id)

        return sorted(scored, key=order)

    def _description(self) -> str:
        better = "smaller" if self.smaller_is_better else "larger"
        return (
            f"Trials of experiment {self.experiment!r}, best first (searcher metric "
            f"{self.metric}, {better} is better; best over every validation)"
        )

    def _lookup(self) -> BestOf | None:
        if self._best_of is None:
            uri = RegistrySettings.from_env().tracking_uri
            if not uri:
                return None
            client = client_for(uri)
            metric, smaller = self.metric, self.smaller_is_better
            self._best_of = lambda run_id: trial_best(client, run_id, metric, smaller)
        return self._best_of


def significant(value: Any) -> Any:
    """Floats to ``DIGITS`` significant digits (non-finite ones as text: JSON has none);
    anything else as it is."""
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else str(value)
    return value


def _created(artifact_id: object) -> UUID:
    """The id a create call returned (Prefect's helpers are typed sync-or-async; the flow
    calls them from sync code, where they return the id)."""
    if not isinstance(artifact_id, UUID):
        raise TypeError(f"expected an artifact id from Prefect, got {artifact_id!r}")
    return artifact_id


def _artifact_key(text: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "trials"
