"""What ``det-tasks experiment list/describe`` show from MLflow: an experiment run's trials,
their progress and best metric, and the best checkpoint; and a trial id -> checkpoint lookup
for ``context.load_checkpoint_trial(trial_id=...)``."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.errors import DetTasksError
from registry.checkpoints import (
    checkpoint_records,
    rank_by_metric,
    resolve_checkpoint_uuid,
    validation_value,
)
from registry.models import trial_runs
from registry.settings import RegistrySettings
from registry.tracking import EXPERIMENT_RUN_TAG, STATE_TAG, TRIAL_TAG, client_for
from registry.trial_states import trial_state

__all__ = [
    "ExperimentView",
    "TrialBest",
    "TrialView",
    "best_point",
    "describe_experiment_run",
    "resolve_trial_checkpoint",
    "trial_best",
]


def best_point(
    points: Iterable[tuple[int, float]], smaller_is_better: bool
) -> tuple[int, float] | None:
    """The best (step, value) of a trial's validations: the searcher's ordering, ties to the
    earlier step, non-finite values never best (the rule ``det.best.*`` on the parent uses)."""
    sign = 1.0 if smaller_is_better else -1.0
    finite = [(step, value) for step, value in points if math.isfinite(value)]
    if not finite:
        return None
    return min(finite, key=lambda p: (sign * p[1], p[0]))


@dataclasses.dataclass(frozen=True)
class TrialBest:
    """A trial's best validation (value, and the batch it was reached at) and its best
    checkpoint: every validation counts, not only the one at the end of a segment."""

    value: float | None
    step: int | None
    checkpoint: str | None


def trial_best(
    client: MlflowClient,
    run_id: str,
    metric: str,
    smaller_is_better: bool,
    records: list[dict[str, Any]] | None = None,
) -> TrialBest:
    """The trial run's best ``validation/<metric>`` over its whole history, and its best
    checkpoint by the same ordering (the latest one when none carries the metric). A run
    with no such history (e.g. imported checkpoints only) falls back to its records."""
    if records is None:
        records = checkpoint_records(client, run_id)
    history = client.get_metric_history(run_id, f"validation/{metric}")
    point = best_point(((m.step, m.value) for m in history), smaller_is_better)
    ranked = rank_by_metric(records, metric, smaller_is_better)
    checkpoint = ranked[0]["uri"] if ranked else (records[-1]["uri"] if records else None)
    value = validation_value(ranked[0], metric) if ranked else None
    if point is None and value is not None:
        point = (int(ranked[0].get("steps_completed", 0)), value)
    return TrialBest(
        value=point[1] if point else None,
        step=point[0] if point else None,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )


@dataclasses.dataclass(frozen=True)
class TrialView:
    trial_id: str
    run_id: str
    state: str  # registry.trial_states: COMPLETED, STOPPED, ERROR... as the trials table says
    batches: int
    metric: float | None  # the best validation value, at batch best_step
    checkpoint: str | None
    best_step: int | None = None


@dataclasses.dataclass(frozen=True)
class ExperimentView:
    name: str
    experiment_id: str
    parent_run_id: str
    metric: str
    smaller_is_better: bool
    trials: list[TrialView]

    @property
    def best(self) -> TrialView | None:
        scored = [t for t in self.trials if t.metric is not None]
        if not scored:
            return None
        sign = 1.0 if self.smaller_is_better else -1.0
        return min(
            scored,
            key=lambda t: (sign * float(t.metric), t.best_step or 0, _trial_order(t.trial_id)),  # type: ignore[arg-type]
        )


def _trial_order(trial_id: str) -> tuple[int, str]:
    return (int(trial_id), "") if trial_id.isdigit() else (1 << 62, trial_id)


def _trial_view(client: MlflowClient, run: Any, metric: str, smaller: bool) -> TrialView:
    records = checkpoint_records(client, run.info.run_id)
    best = trial_best(client, run.info.run_id, metric, smaller, records)
    batches = run.data.metrics.get("batches", 0)
    if records:
        batches = max(batches, max(int(r.get("steps_completed", 0)) for r in records))
    return TrialView(
        trial_id=run.data.tags.get(TRIAL_TAG, "?"),
        run_id=run.info.run_id,
        state=trial_state(run.info.status, run.data.tags.get(STATE_TAG)),
        batches=int(batches),
        metric=best.value,
        checkpoint=best.checkpoint,
        best_step=best.step,
    )


def describe_experiment_run(client: MlflowClient, run_key: str) -> ExperimentView | None:
    """The MLflow side of the experiment run ``run_key`` (the Prefect flow-run id)."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return None
    parents = client.search_runs(
        experiments, filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{run_key}'", max_results=1
    )
    if not parents:
        return None
    parent = parents[0]
    metric = parent.data.tags.get("det.searcher.metric", "")
    smaller = parent.data.tags.get("det.searcher.smaller_is_better", "True") == "True"
    trials = [_trial_view(client, run, metric, smaller) for run in trial_runs(client, parent)]
    trials.sort(key=lambda t: int(t.trial_id) if t.trial_id.isdigit() else 0)
    name = client.get_experiment(parent.info.experiment_id).name
    return ExperimentView(
        name, parent.info.experiment_id, parent.info.run_id, metric, smaller, trials
    )


def resolve_trial_checkpoint(
    trial_id: Any, latest: bool = False, checkpoint_uuid: str | None = None
) -> str:
    """The best (``latest``: the most recent, as a warm start from ``source_trial_id``
    uses) checkpoint URI of a trial, named by its MLflow run id or by a trial number that
    exactly one trial run carries; with ``checkpoint_uuid``, that checkpoint's URI."""
    if checkpoint_uuid is not None:
        return resolve_checkpoint_uuid(checkpoint_uuid)
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise DetTasksError(
            f"trial_id={trial_id!r} needs MLFLOW_TRACKING_URI to find the trial's checkpoint"
        )
    client = client_for(settings.tracking_uri)
    text = str(trial_id).strip()
    if re.fullmatch(r"[0-9a-f]{32}", text):
        run = client.get_run(text)
    else:
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(
            experiments, filter_string=f"tags.`{TRIAL_TAG}` = '{text}'", max_results=50
        )
        if not runs:
            raise DetTasksError(f"no trial run in MLflow has trial id {text!r}")
        if len(runs) > 1:
            ids = ", ".join(r.info.run_id for r in runs[:5])
            raise DetTasksError(
                f"trial id {text!r} names {len(runs)} trial runs (one per experiment run); "
                f"give the MLflow run id of the one you mean, e.g. one of: {ids} "
                "(`det-tasks experiment describe ID` lists them)"
            )
        run = runs[0]
    parent_id = run.data.tags.get("mlflow.parentRunId")
    tags = client.get_run(parent_id).data.tags if parent_id else {}
    metric = tags.get("det.searcher.metric", "")
    smaller = tags.get("det.searcher.smaller_is_better", "True") == "True"
    if latest:
        records = checkpoint_records(client, run.info.run_id)
        if not records:
            raise DetTasksError(f"trial {text!r} (run {run.info.run_id}) has no checkpoint yet")
        return str(records[-1]["uri"])
    view = _trial_view(client, run, metric, smaller)
    if view.checkpoint is None:
        raise DetTasksError(f"trial {text!r} (run {run.info.run_id}) has no checkpoint yet")
    return view.checkpoint
