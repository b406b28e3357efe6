"""Releasing a trial the searcher or a stop ended between segments: its worker frees the
held trial (fire and forget, awaited at the experiment's end) and its MLflow run ends in
the state asked for. A release that finds the trial no longer held (another trial's step
evicted it first, which ends a run PAUSED) leaves that end to ``settle``, once no step runs:
a trial ASHA stopped had stayed PAUSED in MLflow (a CI run's
test_asha_stops_worse_trials_early)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from prefect import get_run_logger

from cluster.held_trials import StepResult
from cluster.steps import StepFuture, release_on, wait_for_releases
from flows.tasks import TrialRef
from registry.runs.tracking import ExperimentRuns
from registry.runs.trial_states import PRUNED

__all__ = ["TrialReleases"]


class TrialReleases:
    """The release steps of one flow run, and the state each trial's latest one asked for."""

    def __init__(self, runs: ExperimentRuns) -> None:
        self.runs = runs
        self.futures: list[StepFuture] = []
        # trial -> its latest release and the state it ends in, while it is not started again
        self.latest: dict[int, tuple[StepFuture, str]] = {}

    def submit(self, ref: TrialRef, result: StepResult, stopped_as: str | None) -> None:
        """Ask the worker that ran the trial's last step to end it there; ``stopped_as``: its
        run's det.state (STOPPED by the searcher: FINISHED; PAUSED or CANCELED: KILLED)."""
        request = dataclasses.replace(
            ref.request("release", result.position, result.position), stopped_as=stopped_as
        )
        future = release_on(result.worker, request)
        self.futures.append(future)
        if stopped_as is not None:
            self.latest[ref.spec.trial_id] = (future, stopped_as)

    def restarted(self, trial_id: int) -> None:
        """The trial runs again (promoted, resumed): its release is spent."""
        self.latest.pop(trial_id, None)

    def after_last(self, callback: Callable[[object], None]) -> bool:
        """Run ``callback`` once the latest release is done; False if there is none."""
        if not self.futures:
            return False
        self.futures[-1].add_done_callback(callback)
        return True

    def wait(self, timeout_s: float = 120.0) -> None:
        if self.futures:
            wait_for_releases(self.futures, timeout_s)

    def settle(self, run_ids: Mapping[int, str], pruned: set[int]) -> None:
        """End, in the state asked for (PRUNED for ``pruned`` trials), the runs of trials
        whose latest release did not find them held. Only once no step runs: a promoted
        segment of the trial could otherwise be running elsewhere."""
        for trial_id, (future, state) in sorted(self.latest.items()):
            if not future.done() or _released(future):
                continue
            state = PRUNED if trial_id in pruned else state
            run_id = run_ids[trial_id]
            self.runs.finish(run_id, "KILLED", state)  # the state's own status wins
            get_run_logger().info(
                "trial %d (MLflow run %s) was no longer held where its release went (another "
                "trial's step had taken its worker): its run ends %s here",
                trial_id,
                run_id,
                state,
            )


def _released(future: StepFuture) -> bool:
    """Whether a finished release step ended its trial (an erred one, its worker gone with
    the trial, did not)."""
    try:
        return bool(future.result().released)
    except Exception:
        return False
