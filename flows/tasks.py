"""The Prefect tasks of one trial: ``train trial-3 0-500``, ``validate trial-3 @500``,
``checkpoint trial-3 @500``, each taking the previous one's result as its input (so the
flow-run graph draws a trial as a chain and ASHA promotions extend it).

A task is a thin record in Prefect: its work runs on a warm Dask worker (cluster.held_trials),
addressed by position, so a retry (max_restarts) continues from the trial's checkpoint with
exactly equal results. Each task's name says its step and trial; its first log line names
the trial's MLflow run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from cluster.held_trials import StepRequest, StepResult, TrialFailed
from cluster.steps import run_step_explained
from det_tasks.errors import StepFailed
from det_tasks.runner.trial_spec import TrialSpec

__all__ = [
    "TrialFailed",
    "TrialRef",
    "checkpoint",
    "retry_unless_final",
    "train",
    "validate",
]


@dataclasses.dataclass(frozen=True)
class TrialRef:
    """A trial as the flow's tasks see it: how to build it, and where it is recorded."""

    spec: TrialSpec
    parent_run_id: str
    experiment_id: str
    mlflow_run_id: str
    holdable: bool = True  # False: whole segments in a det-tasks run process
    package: str | None = None
    gpus: int = 0
    pool_resource: str | None = None  # the Dask resource of its pool's workers, if named

    def request(
        self, kind: str, start: int, stop: int | None, release: bool = False
    ) -> StepRequest:
        return StepRequest(
            trial=self.spec,
            kind=kind,
            start=start,
            stop=stop,
            parent_run_id=self.parent_run_id,
            experiment_id=self.experiment_id,
            package=self.package,
            release_after=release,
            pool_resource=self.pool_resource,
        )

    def task_name(self, kind: str, where: str) -> str:
        """``train trial-3 0-500``, ``validate trial-3 @500``: short and ASCII, as Prefect's
        graph draws labels in a font without "→". The MLflow run is in the trials table
        and the task's log, not in Prefect tags: a tagged task takes a concurrency-slot
        write on the Prefect server before it starts, which SQLite refuses (503) when many
        trials write at once."""
        return f"{kind} trial-{self.spec.trial_id} {where}"


def retry_unless_final(task: Any, task_run: Any, state: Any) -> bool:
    """Retry (up to max_restarts) unless the failure is one a retry would meet again: a
    config or entrypoint error."""
    error = state.data
    return not (isinstance(error, StepFailed) and not error.retryable)


def _step(request: StepRequest, workers: list[str] | None, gpus: int) -> StepResult:
    """Run the step on one of ``workers`` (cluster.steps); a failure says which attempt
    it was."""
    try:
        return run_step_explained(request, workers, gpus)
    except StepFailed as err:
        raise _counted(err) from None


def _counted(err: StepFailed) -> StepFailed:
    context = TaskRunContext.get()
    return err.after_attempts(context.task_run.run_count if context is not None else 1)


@task(
    name="train",
    retry_delay_seconds=1,
    retry_condition_fn=retry_unless_final,
    cache_policy=NO_CACHE,
)
def train(
    trial: TrialRef,
    start: int,
    stop: int | None,
    after: StepResult | None = None,
    workers: list[str] | None = None,
    experiment_best: float | None = None,
) -> StepResult:
    """Train the trial from batch ``start`` to ``stop`` (None: to searcher.max_length;
    ``after``: the trial's previous step, for the graph; ``experiment_best``: the search's
    best metric so far)."""
    kind = "train" if trial.holdable else "segment"
    request = dataclasses.replace(trial.request(kind, start, stop), experiment_best=experiment_best)
    result = _step(request, workers, trial.gpus)
    _log(trial, "trained to batch", result)
    return result


@task(
    name="validate",
    retry_delay_seconds=1,
    retry_condition_fn=retry_unless_final,
    cache_policy=NO_CACHE,
)
def validate(trial: TrialRef, after: StepResult) -> StepResult:
    """Validate the trial at the position ``after`` left it."""
    if not trial.holdable:  # validated inside its segment's process
        return after
    at = after.position
    result = _step(trial.request("validate", at, at), [after.worker], trial.gpus)
    _log(trial, "validated at batch", result, result.validation)
    return result


@task(
    name="checkpoint",
    retry_delay_seconds=1,
    retry_condition_fn=retry_unless_final,
    cache_policy=NO_CACHE,
)
def checkpoint(
    trial: TrialRef, after: StepResult, release: bool = False, stopped_as: str | None = None
) -> StepResult:
    """Checkpoint the trial at the position ``after`` left it; ``release``: end the held
    trial afterwards (its last segment, or ``stopped_as`` PAUSED/CANCELED: stopped on
    request, its run then ends KILLED). Carries the validation forward."""
    if not trial.holdable:
        return after
    at = after.position
    request = dataclasses.replace(
        trial.request("checkpoint", at, at, release), stopped_as=stopped_as
    )
    result = _step(request, [after.worker], trial.gpus)
    _log(trial, "checkpoint at batch", result, result.checkpoint)
    return dataclasses.replace(result, validation=after.validation)


def _log(trial: TrialRef, what: str, result: StepResult, detail: Any = None) -> None:
    how = "warm" if result.warm else f"restored from {result.restored_from or 'batch 0'}"
    ended = f"; trial ended in {result.end_seconds:.3f} s" if result.end_seconds is not None else ""
    get_run_logger().info(
        "trial %s (MLflow run %s) %s %d on %s (%s, %.3f s%s) on host %s%s",
        trial.spec.trial_id,
        trial.mlflow_run_id,
        what,
        result.position,
        result.worker,
        how,
        result.seconds,
        ended,
        result.host,
        f": {detail}" if detail is not None else "",
    )
