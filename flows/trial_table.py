"""The experiment flow run's table of trials and its progress, as two Prefect artifacts
created once and updated in place as trials run and end, so the UI and ``--watch`` users
see results without reading logs (a ``create_*_artifact`` call per update would store a new
copy of the whole table each time: quadratic in the number of trials).

Every number in a row (batches trained, the searcher metric's best, the batch it was
reached at, its latest value, the best checkpoint) is registry.experiments.view's
``trial_progress`` of the trial's MLflow run: the reading ``det experiment describe`` and
``list-trials`` show too. A row is read again when its trial changed (a segment ended, it
stopped, it was released), while it runs (at most every ``LIVE_REFRESH_S``), and all rows
by ``publish()``, which the flow calls once its trials are released: rows keep their numbers
after a pause or a kill. An activated experiment's table starts with every trial its parent
run has, the ones that ended before this flow run included. The best row is also written
to the parent run's ``det.best.*`` tags whenever it changes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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

from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.hyperparameters import flatten_hparams
from det_tasks.config.lengths import in_batches_or_epochs
from det_tasks.errors import ConfigError
from registry.experiments.summary import BEST_TAG, BestTrial, log_best_tags
from registry.experiments.view import (
    TrialProgress,
    read_trial_progress,
    trial_runs_of,
)
from registry.runs.run_records import STATE_TAG, TRIAL_TAG
from registry.runs.tracking import client_for
from registry.runs.trial_states import CANCELED, COMPLETED, ERROR, STOPPED, trial_state
from registry.servers.settings import RegistrySettings

__all__ = [
    "BEST_TAG",
    "FINISHED_STATES",
    "PRUNED",
    "SETTLED_STATES",
    "TrialTable",
    "searcher_batches",
    "significant",
]

PRUNED = "PRUNED"  # ended early by an optuna searcher's pruner (its run: FINISHED, det.state)

# States whose trial run has been released, so its MLflow history is complete.
SETTLED_STATES = frozenset({COMPLETED, STOPPED, PRUNED})
# States that count as done for the progress artifact.
FINISHED_STATES = SETTLED_STATES | {CANCELED, ERROR, "INVALID_HP"}
WAITING = frozenset({"QUEUED", "PREEMPTED"})  # states whose reason the table shows
DIGITS = 4  # significant digits of every number the table shows
# How often publish_soon sends the table at most (see publish_interval_s).
MIN_PUBLISH_INTERVAL_S = 2.0
PUBLISH_INTERVAL_PER_TRIAL_S = 0.01
LIVE_REFRESH_S = 10.0  # while trials run, their rows are read again this often

ProgressOf = Callable[[str], TrialProgress]  # MLflow run id -> the trial's numbers
# A trial's hyperparameters -> its searcher length in batches (None: only its data loader knows)
TrialBatches = Callable[[dict[str, Any]], int | None]
NO_PROGRESS = TrialProgress(0, None, None, None, None, None)
_logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Row:
    trial_id: int
    hparams: dict[str, Any]
    mlflow_run_id: str
    mlflow: str
    state: str = "QUEUED"
    progress: TrialProgress = NO_PROGRESS
    reason: str = ""  # why a QUEUED or PREEMPTED trial waits (the job queue's words)
    stale: bool = True  # changed since its numbers were last read


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
        progress_of: ProgressOf | None = None,
        parent_run_id: str | None = None,
        client: Any = None,
        trial_batches: TrialBatches | None = None,
    ) -> None:
        """``total_trials``: how many the searcher will run, for the progress artifact
        (default: the trials known so far). ``progress_of``: a trial's numbers (default:
        ``read_trial_progress`` from ``client``, else the MLflow server in
        MLFLOW_TRACKING_URI). ``parent_run_id``: the experiment's parent run, whose trials
        the table starts with and whose ``det.best.*`` tags it keeps. ``trial_batches``:
        a trial's length in batches (``searcher_batches``), for progress in batches."""
        self.key = _artifact_key(f"{experiment}-trials")
        self.progress_key = _artifact_key(f"{experiment}-progress")
        self.experiment = experiment
        self.metric = metric
        self.smaller_is_better = smaller_is_better
        self.mlflow_link = mlflow_link
        self.total_trials = total_trials
        self.parent_run_id = parent_run_id
        self._client = client
        self._progress_of = progress_of
        self.trial_batches = trial_batches
        self.rows: dict[int, _Row] = {}
        self._table_id: UUID | None = None
        self._progress_id: UUID | None = None
        self._published_at = -math.inf  # time.monotonic() of the last publish
        self._stale = False  # changed since then (publish_soon held it back)
        self._adopted = parent_run_id is None  # the parent's earlier trials are rows
        self._best_written: tuple[Any, ...] | None = None

    def add(self, trial_id: int, hparams: dict[str, Any], mlflow_run_id: str) -> None:
        row = self.rows.get(trial_id)
        if row is None:
            link = self.mlflow_link(mlflow_run_id)
            self.rows[trial_id] = _Row(trial_id, hparams, mlflow_run_id, link)
        else:  # adopted from MLflow: the searcher's own values replace the params' text
            row.hparams = hparams

    def set_state(self, trial_id: int, state: str, reason: str = "") -> None:
        """The trial's state; ``reason``: why it waits (shown while it is QUEUED or
        PREEMPTED, in a column the table has only while some trial waits)."""
        row = self.rows[trial_id]
        row.state, row.reason, row.stale = state, reason, True

    def segment_done(
        self, trial_id: int, batches: int, metric: float, checkpoint: str | None
    ) -> None:
        """A segment ended (at ``batches``; its validation ``metric``, its checkpoint):
        the row is read again from MLflow at the next publish."""
        self.rows[trial_id].stale = True

    # ---- what the table says ------------------------------------------------------------
    def refresh(self, every_row: bool = False) -> None:
        """Read the numbers of the rows that changed or run (``every_row``: of all)."""
        progress_of = self._lookup()
        if progress_of is None:
            return
        for row in self.rows.values():
            if every_row or row.stale or row.state == "RUNNING":
                try:
                    row.progress, row.stale = progress_of(row.mlflow_run_id), False
                except Exception as err:  # MLflow busy or away: the old numbers, read later
                    _logger.warning("trials table: trial %d not read (%s)", row.trial_id, err)

    def best(self) -> dict[str, Any] | None:
        """The best trial as the flow's summary reports it (same trial, value, batch and
        checkpoint as the table's first row)."""
        ranked = self._ranked()
        if not ranked or ranked[0].progress.best is None:
            return None
        row = ranked[0]
        return {
            "trial_id": row.trial_id,
            "metric": row.progress.best,
            "step": row.progress.best_step,
            "hparams": row.hparams,
            "checkpoint": row.progress.checkpoint,
            "batches_trained": row.progress.batches,
        }

    def table(self) -> list[dict[str, Any]]:
        """The rows as published, best first, numbers to ``DIGITS`` significant digits."""
        fixed = ["trial", "state", "batches", f"best {self.metric}", "best at batch"]
        fixed += [self.metric, "best checkpoint", "mlflow", "waiting for"]
        rows = []
        for row in self._ranked():
            hparams = {
                (name if name not in fixed else f"hp.{name}"): significant(value)
                for name, value in flatten_hparams(row.hparams).items()
            }
            numbers = row.progress
            rows.append(
                {
                    "trial": row.trial_id,
                    "state": row.state,
                    "batches": numbers.batches,
                    f"best {self.metric}": significant(numbers.best),
                    "best at batch": numbers.best_step,
                    self.metric: significant(numbers.latest),
                    **hparams,
                    "best checkpoint": numbers.checkpoint,
                    "mlflow": row.mlflow,
                }
            )
        waiting = {r.trial_id: r.reason for r in self.rows.values() if r.state in WAITING}
        if any(waiting.values()):
            for shown in rows:
                shown["waiting for"] = waiting.get(shown["trial"], "")
        return rows

    def progress(self) -> tuple[int, int]:
        """(trials finished, trials in all)."""
        done = sum(row.state in FINISHED_STATES for row in self.rows.values())
        return done, max(self.total_trials or 0, len(self.rows))

    def batches(self) -> tuple[int, int] | None:
        """(batches trained, batches planned) over the trials in all: a finished trial
        counts its whole length (ASHA stops most trials short of it), a trial not yet
        proposed the known trials' mean length. None where a trial's length in batches is
        unknown (epochs without ``records_per_epoch``) or no trial is known yet."""
        if self.trial_batches is None or not self.rows:
            return None
        trained = planned = 0
        for row in self.rows.values():
            length = self.trial_batches(row.hparams)
            if length is None:
                return None
            done = row.state in FINISHED_STATES
            trained += length if done else min(row.progress.batches, length)
            planned += length
        not_proposed = self.progress()[1] - len(self.rows)
        return trained, planned + round(not_proposed * planned / len(self.rows))

    def percent(self) -> float:
        """How much of the experiment is done: its batches trained over those planned, or
        (lengths unknown) its trials finished over all. Counting only finished trials, a
        one-trial experiment read 0% until its end."""
        return _percent(self.batches() or self.progress())

    # ---- Prefect ------------------------------------------------------------------------
    def publish_soon(self) -> None:
        """Publish now unless the last publish was under ``publish_interval_s`` ago; then
        ``publish_if_stale`` publishes once it is due. Every publish sends the whole table,
        so one per trial end made an experiment's bookkeeping grow with the square of its
        trials (1,024 trials: a 100 KB table written 2,000 times)."""
        if time.monotonic() - self._published_at >= self.publish_interval_s:
            self._send(every_row=False)
        else:
            self._stale = True

    def publish_if_stale(self) -> None:
        """Publish what ``publish_soon`` held back once it is due, and running trials'
        numbers every ``LIVE_REFRESH_S`` (or ``publish_interval_s``, when longer)."""
        running = any(row.state == "RUNNING" for row in self.rows.values())
        every = max(LIVE_REFRESH_S, self.publish_interval_s)
        if running and time.monotonic() - self._published_at >= every:
            self._stale = True
        if self._stale:
            self.publish_soon()

    @property
    def publish_interval_s(self) -> float:
        """2 s, or 10 ms a trial for large tables (10 s at 1,000 trials): what the tables
        sent cost stays in proportion to the experiment's length, not its square."""
        return max(MIN_PUBLISH_INTERVAL_S, PUBLISH_INTERVAL_PER_TRIAL_S * len(self.rows))

    def publish(self) -> None:
        """Every row read again, then the table and progress artifacts as they are now:
        created by the first call (in the flow run), updated in place by later ones. The
        flow calls it once its trials are released (their MLflow runs complete)."""
        self._send(every_row=True)

    def _send(self, every_row: bool) -> None:
        self._published_at, self._stale = time.monotonic(), False
        try:
            self._adopt()
        except Exception as err:  # MLflow busy or away: the rows this flow run knows
            _logger.warning("trials table: the parent run's trials not read (%s)", err)
        self.refresh(every_row)
        rows = self.table()
        if self._table_id is None:
            self._table_id = _existing(self.key)
        if self._table_id is None:
            self._table_id = _created(
                create_table_artifact(table=rows, key=self.key, description=self._description())
            )
        else:
            get_client(sync_client=True).update_artifact(
                self._table_id, ArtifactUpdate(data=json.dumps(rows, default=str))
            )
        done, total = self.progress()
        batches = self.batches()
        percent = _percent(batches or (done, total))
        text = f"{done} of {total} trials of experiment {self.experiment!r} finished"
        if batches is not None:
            text += f" ({batches[0]} of {batches[1]} batches trained)"
        if self._progress_id is None:
            self._progress_id = _existing(self.progress_key)
        if self._progress_id is None:
            self._progress_id = _created(
                create_progress_artifact(percent, key=self.progress_key, description=text)
            )
        else:
            update_progress_artifact(self._progress_id, percent, description=text)
        try:
            self._write_best()
        except Exception as err:  # written again with the next change
            _logger.warning("trials table: det.best.* not written (%s)", err)

    def _ranked(self) -> list[_Row]:
        sign = 1.0 if self.smaller_is_better else -1.0

        def order(row: _Row) -> tuple[int, float, int, int]:
            best = row.progress
            if best.best is None:
                return (1, 0.0, 0, row.trial_id)
            return (0, sign * best.best, best.best_step or 0, row.trial_id)

        return sorted(self.rows.values(), key=order)

    def _description(self) -> str:
        better = "smaller" if self.smaller_is_better else "larger"
        return (
            f"Trials of experiment {self.experiment!r}, best first (searcher metric "
            f"{self.metric}, {better} is better; best over every validation)"
        )

    def _mlflow(self) -> Any:
        if self._client is None:
            uri = RegistrySettings.from_env().tracking_uri
            if uri:
                self._client = client_for(uri)
        return self._client

    def _lookup(self) -> ProgressOf | None:
        if self._progress_of is None:
            client = self._mlflow()
            if client is None:
                return None
            metric, smaller = self.metric, self.smaller_is_better
            self._progress_of = lambda run_id: read_trial_progress(client, run_id, metric, smaller)
        return self._progress_of

    def _adopt(self) -> None:
        """Rows for the trials the parent run already has (an activated experiment's
        trials that ended before this flow run), once."""
        client = self._mlflow()
        if self._adopted or client is None:
            return
        parent = client.get_run(self.parent_run_id)
        for run in trial_runs_of(client, parent):
            trial_id = _trial_number(run)
            if trial_id is None or trial_id in self.rows:
                continue
            hparams = {k[3:]: _param_value(v) for k, v in run.data.params.items() if k[:3] == "hp."}
            self.add(trial_id, hparams, run.info.run_id)
            self.rows[trial_id].state = trial_state(run.info.status, run.data.tags.get(STATE_TAG))
        self._adopted = True

    def _write_best(self) -> None:
        """The best row on the parent run's ``det.best.*`` tags (as registry.experiments.summary
        names them), when it changed."""
        best, client = self.best(), self._mlflow()
        if best is None or client is None or self.parent_run_id is None:
            return
        row = self.rows[best["trial_id"]]
        written = (best["trial_id"], best["metric"], best["step"], best["checkpoint"])
        if written == self._best_written:
            return
        best_row = BestTrial(
            run_id=row.mlflow_run_id,
            trial_id=str(best["trial_id"]),
            metric=self.metric,
            value=best["metric"],
            step=int(best["step"]),
            hparams={k: str(v) for k, v in flatten_hparams(row.hparams).items()},
            checkpoint_uri=str(best["checkpoint"]) if best["checkpoint"] else None,
        )
        log_best_tags(client, self.parent_run_id, best_row)
        self._best_written = written


def _percent(counted: tuple[int, int]) -> float:
    return 100.0 * counted[0] / counted[1] if counted[1] else 0.0


def searcher_batches(config: ExperimentConfig) -> TrialBatches:
    """A trial's searcher length in batches, from its hyperparameters (their
    ``global_batch_size`` turns records, and epochs with ``records_per_epoch``, into
    batches, as the trial's own loop does)."""
    length = config.searcher.max_length

    def of(hparams: dict[str, Any]) -> int | None:
        if length is None:
            return None
        try:
            counted = in_batches_or_epochs(
                length, hparams.get("global_batch_size"), config.records_per_epoch
            )
        except ConfigError:  # records without a global_batch_size: the trial says so
            return None
        return counted.value if counted.unit == "batches" else None

    return of


def _existing(key: str) -> UUID | None:
    """This flow run's artifact ``key``, when an earlier execution of it made one (an
    activated experiment's flow run runs again): updated, so the run shows one table."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(run_id))])),
            limit=1,
        )
    return found[0].id if found else None


def _trial_number(run: Any) -> int | None:
    text = run.data.tags.get(TRIAL_TAG, "")
    return int(text) if text.isdigit() else None


def _param_value(text: str) -> Any:
    """A hyperparameter as its MLflow param's text: a number or JSON value back, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


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
