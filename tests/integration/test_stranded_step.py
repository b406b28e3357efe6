"""Issue 30's watchdog: a step that no worker of the cluster can run (here a GPU step on a
CPU-only cluster) fails loudly, naming the step, the trial and the cause, within a minute,
instead of hanging the experiment. A real Dask cluster, at the default bound."""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import FLOW_MODEL

pytestmark = pytest.mark.slow  # waits out the default 60 s bound


def test_a_step_no_worker_can_run_fails_loudly_within_a_minute() -> None:
    from distributed import Client, LocalCluster

    from cluster.held_trials import StepRequest
    from cluster.steps import STRANDED_AFTER_S, WATCH_INTERVAL_S, StepStranded, submit_step
    from det_tasks.runner.held import TrialSpec

    spec = TrialSpec(str(FLOW_MODEL / "grid.yaml"), str(FLOW_MODEL), (), 3, {"hidden": 4})
    request = StepRequest(spec, "train", 0, 8, parent_run_id="p", experiment_id="e")
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False)
    with cluster, Client(cluster):
        started = time.monotonic()
        with pytest.raises(StepStranded) as failed:
            submit_step(request, gpus=1)
        took = time.monotonic() - started
    assert STRANDED_AFTER_S <= took <= STRANDED_AFTER_S + 2 * WATCH_INTERVAL_S
    assert str(failed.value) == (
        "step train of trial 3 (batches 0..8) found no worker with GPU=1 to run it for 60 s; "
        "the cluster has 1 worker(s)"
    )
