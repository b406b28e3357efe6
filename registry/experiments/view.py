"""What an experiment run's trials have done, as MLflow records it: one reading
(``trial_progress``) of each trial's batches trained, best and latest searcher metric and
best checkpoint, for ``det experiment describe|list-trials``, ``det trial describe``, the
flow's Prefect trials table and the parent run's ``det.best.*`` tags alike, live and after
any stop; and a trial id -> checkpoint lookup for ``context.load_checkpoint_trial``.

It reads through any client with MlflowClient's read calls: ``det`` passes
registry.runs.mlflow_rest's reader, so this module imports no MLflow itself.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from det_tasks.errors import DetTasksError
from registry.runs.run_nodes import nodes_of
from registry.runs.run_records import (
    EXPERIMENT_RUN_TAG,
    PARENT_TAG,
    QUEUE_REASON_TAG,
    STATE_TAG,
    TRIAL_TAG,
    checkpoint_records_of,
    rank_by_metric,
    validation_value,
)
from registry.runs.trial_states import trial_state

__all__ = [
    "PROGRESS_KEY",
    "ExperimentSummary",
    "ExperimentView",
    "TrialProgress",
    "TrialView",
    "best_point",
    "describe_experiment_run",
    "find_parent",
    "read_trial_progress",
    "resolve_trial_checkpoint",
    "searcher_of",
    "side_by_side",
    "summarize_experiment_runs",
    "trial_order",
    "trial_progress",
    "trial_runs_of",
    "trial_view",
]

BEST_TAG = "det.best."  # registry.experiments.summary's (which imports MLflow)
PROGRESS_KEY = "progress/batches"  # what the harness reports at every training report
PARALLEL_READS = 8  # metric histories read at once (one request each)
T = TypeVar("T")
R = TypeVar("R")


def best_point(
    points: Iterable[tuple[int, float]], smaller_is_better: bool
) -> tuple[int, float] | None:
    """The best (step, value) of a trial's validations: the searcher's ordering, ties to the
    earlier step, non-finite values never best."""
    sign = 1.0 if smaller_is_better else -1.0
    finite = [(step, value) for step, value in points if math.isfinite(value)]
    if not finite:
        return None
    return min(finite, key=lambda p: (sign * p[1], p[0]))


@dataclasses.dataclass(frozen=True)
class TrialProgress:
    """How far a trial got and how good it was, from its MLflow run alone."""

    batches: int  # trained: progress/batches (at least its last validation and checkpoint)
    best: float | None  # the best validation of the searcher metric, over all of them
    best_step: int | None
    latest: float | None  # the validation at the largest batch (MLflow's "latest")
    latest_step: int | None
    checkpoint: str | None  # the best checkpoint by the same ordering (else the newest)


def trial_progress(
    run: Any, history: Sequence[Any], metric: str, smaller_is_better: bool
) -> TrialProgress:
    """The one reading of a trial's numbers that every view shows, from its run (tags:
    checkpoint records; latest metrics: ``progress/batches``) and the history of
    ``validation/<metric>`` (points with step, value, timestamp). A run without such
    history (imported checkpoints only) takes its best from the checkpoint records."""
    records = checkpoint_records_of(run)
    best = best_point(((m.step, m.value) for m in history), smaller_is_better)
    ranked = rank_by_metric(records, metric, smaller_is_better) if metric else []
    if best is None and ranked:
        value = validation_value(ranked[0], metric)
        best = None if value is None else (int(ranked[0]["steps_completed"]), value)
    latest = max(history, key=lambda m: (m.step, m.timestamp), default=None)
    reached = [run.data.metrics.get(PROGRESS_KEY, 0.0), *(m.step for m in history)]
    reached += [r["steps_completed"] for r in records]
    newest = str(records[-1]["uri"]) if records else None
    return TrialProgress(
        batches=int(max(reached)),
        best=None if best is None else best[1],
        best_step=None if best is None else best[0],
        latest=None if latest is None else latest.value,
        latest_step=None if latest is None else latest.step,
        checkpoint=str(ranked[0]["uri"]) if ranked else newest,
    )


def read_trial_progress(
    client: Any, run: Any, metric: str, smaller_is_better: bool
) -> TrialProgress:
    """``trial_progress`` of ``run`` (a run, or its id), its history read from ``client``."""
    if isinstance(run, str):
        run = client.get_run(run)
    history = client.get_metric_history(run.info.run_id, f"validation/{metric}") if metric else []
    return trial_progress(run, history, metric, smaller_is_better)


@dataclasses.dataclass(frozen=True)
class TrialView:
    trial_id: str
    run_id: str
    state: str  # registry.runs.trial_states: COMPLETED, STOPPED, CANCELED... as the table says
    progress: TrialProgress
    reason: str = ""  # a QUEUED or PREEMPTED trial: why it waits for a slot
    nodes: tuple[str, ...] = ()  # the hosts it ran on, oldest first (registry.runs.run_nodes)

    @property
    def batches(self) -> int:
        return self.progress.batches

    @property
    def metric(self) -> float | None:
        """The best validation value, reached at ``best_step``."""
        return self.progress.best

    @property
    def best_step(self) -> int | None:
        return self.progress.best_step

    @property
    def latest(self) -> float | None:
        return self.progress.latest

    @property
    def checkpoint(self) -> str | None:
        return self.progress.checkpoint


@dataclasses.dataclass(frozen=True)
class ExperimentView:
    name: str
    experiment_id: str
    parent_run_id: str
    metric: str
    smaller_is_better: bool
    trials: list[TrialView]
    parent: Any = None  # the parent run as the client returned it

    @property
    def best(self) -> TrialView | None:
        scored = [t for t in self.trials if t.metric is not None]
        if not scored:
            return None
        sign = 1.0 if self.smaller_is_better else -1.0
        return min(
            scored,
            key=lambda t: (sign * float(t.metric), t.best_step or 0, trial_order(t.trial_id)),  # type: ignore[arg-type]
        )


def trial_order(trial_id: str) -> tuple[int, str]:
    """Trials by number (1, 2, 10), anything else after them."""
    return (int(trial_id), "") if trial_id.isdigit() else (1 << 62, trial_id)


def trial_view(client: Any, run: Any, metric: str, smaller_is_better: bool) -> TrialView:
    return TrialView(
        trial_id=run.data.tags.get(TRIAL_TAG, "?"),
        run_id=run.info.run_id,
        state=trial_state(run.info.status, run.data.tags.get(STATE_TAG)),
        progress=read_trial_progress(client, run, metric, smaller_is_better),
        reason=run.data.tags.get(QUEUE_REASON_TAG, ""),
        nodes=tuple(nodes_of(run.data.tags)),
    )


def searcher_of(parent: Any) -> tuple[str, bool]:
    """The searcher metric and its ordering, as the parent run records them."""
    tags = parent.data.tags
    return tags.get("det.searcher.metric", ""), tags.get(
        "det.searcher.smaller_is_better", "True"
    ) == "True"


def find_parent(client: Any, run_key: str) -> tuple[Any, str] | None:
    """The MLflow parent run of the experiment run ``run_key`` (the Prefect flow-run id),
    and its MLflow experiment's name; None before the flow has made it."""
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    if not experiments:
        return None
    parents = client.search_runs(
        list(experiments), filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{run_key}'", max_results=1
    )
    if not parents:
        return None
    return parents[0], experiments.get(parents[0].info.experiment_id, "")


def trial_runs_of(client: Any, parent: Any) -> list[Any]:
    """The trial runs under an experiment's parent run (at most 1,000, as ``models`` reads)."""
    return list(
        client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        )
    )


def describe_experiment_run(client: Any, run_key: str) -> ExperimentView | None:
    """The MLflow side of the experiment run ``run_key`` (the Prefect flow-run id): three
    requests, and one per trial (those side by side)."""
    found = find_parent(client, run_key)
    if found is None:
        return None
    parent, name = found
    metric, smaller = searcher_of(parent)
    runs = trial_runs_of(client, parent)
    trials = side_by_side(lambda run: trial_view(client, run, metric, smaller), runs)
    trials.sort(key=lambda t: trial_order(t.trial_id))
    return ExperimentView(
        name, parent.info.experiment_id, parent.info.run_id, metric, smaller, trials, parent
    )


@dataclasses.dataclass(frozen=True)
class ExperimentSummary:
    """One row of ``det experiment list``: the MLflow side of an experiment run."""

    name: str
    metric: str
    trials: int
    best: float | None  # the parent's det.best.<metric> tag: the best validation so far


def summarize_experiment_runs(client: Any, run_keys: Sequence[str]) -> dict[str, ExperimentSummary]:
    """The MLflow side of a page of experiment runs (Prefect flow-run ids) in a fixed
    number of requests, however long the page (MLflow's pages of 1,000 aside): the
    experiments, the parent runs newest first until every key is found, and the trial runs
    under their experiments. Keys without a parent yet (a flow still starting) are left
    out. The best value is the parent's ``det.best.*`` tag, which the flow keeps as its
    trials validate (registry.experiments.summary), not the trials' histories ``describe`` reads."""
    names = {e.experiment_id: e.name for e in client.search_experiments()}
    wanted = set(run_keys)
    if not names or not wanted:
        return {}
    parents: dict[str, Any] = {}
    newest_first = ["attributes.start_time DESC"]
    for run in _pages(client, list(names), f"tags.`{EXPERIMENT_RUN_TAG}` != ''", newest_first):
        key = run.data.tags.get(EXPERIMENT_RUN_TAG)
        if key in wanted and key not in parents:
            parents[key] = run
            if len(parents) == len(wanted):
                break
    by_parent = {run.info.run_id: key for key, run in parents.items()}
    trials = dict.fromkeys(parents, 0)
    experiments = sorted({run.info.experiment_id for run in parents.values()})
    for run in _pages(client, experiments, f"tags.`{PARENT_TAG}` != ''") if experiments else ():
        key = by_parent.get(run.data.tags.get(PARENT_TAG, ""))
        if key is not None:
            trials[key] += 1
    summaries = {}
    for key, parent in parents.items():
        metric, _ = searcher_of(parent)
        best = parent.data.tags.get(BEST_TAG + metric) if metric else None
        summaries[key] = ExperimentSummary(
            names.get(parent.info.experiment_id, ""), metric, trials[key], _number(best)
        )
    return summaries


def _pages(
    client: Any, experiment_ids: list[str], filter_string: str, order_by: list[str] | None = None
) -> Iterable[Any]:
    """Every run the search finds, a page (one request) at a time."""
    token = None
    while True:
        page = client.search_runs(
            experiment_ids, filter_string=filter_string, order_by=order_by, page_token=token
        )
        yield from page
        token = getattr(page, "token", None)
        if not token:
            return


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def side_by_side(function: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[function(i) for i in items]``, up to ``PARALLEL_READS`` at once (each waits on
    one request to a server)."""
    if len(items) < 2:
        return [function(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(PARALLEL_READS, len(items))) as pool:
        return list(pool.map(function, items))


def resolve_trial_checkpoint(
    trial_id: Any, latest: bool = False, checkpoint_uuid: str | None = None
) -> str:
    """The best (``latest``: the most recent, as a warm start from ``source_trial_id``
    uses) checkpoint URI of a trial, named by its MLflow run id or by a trial number that
    exactly one trial run carries; with ``checkpoint_uuid``, that checkpoint's URI."""
    from registry.checkpoints.store import resolve_checkpoint_uuid
    from registry.runs.tracking import client_for
    from registry.servers.settings import RegistrySettings

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
    parent_id = run.data.tags.get(PARENT_TAG)
    metric, smaller = searcher_of(client.get_run(parent_id)) if parent_id else ("", True)
    if latest:
        records = checkpoint_records_of(run)
        if not records:
            raise DetTasksError(f"trial {text!r} (run {run.info.run_id}) has no checkpoint yet")
        return str(records[-1]["uri"])
    view = trial_view(client, run, metric, smaller)
    if view.checkpoint is None:
        raise DetTasksError(f"trial {text!r} (run {run.info.run_id}) has no checkpoint yet")
    return view.checkpoint
