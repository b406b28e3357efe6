"""A step still being waited on when the flow closes its Dask client (the flow is ending:
another trial failed, or it was stopped) ends its waiter at once with StepAbandoned. Before,
the waiter took the close for a lost scheduler: it logged a false "away for more than 600 s"
or, with the client's loop stopping under it, waited forever, and the flow process never
exited (a CI run's 600 s timeout)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.integration.helpers import FLOW_MODEL

_LET_GO = threading.Event()  # the long step returns once the test has looked


def _sleep(_: Any) -> None:
    _LET_GO.wait(30)


def test_closing_the_client_ends_a_waiting_step_with_step_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from distributed import Client, LocalCluster

    import cluster.steps as steps
    from cluster.held_trials import StepRequest
    from det_tasks.runner.held import TrialSpec

    def submit_a_long_step(client: Client, request: Any, worker: Any, gpus: int) -> Any:
        return client.submit(_sleep, request, pure=False)

    monkeypatch.setattr(steps, "_submit", submit_a_long_step)
    spec = TrialSpec(str(FLOW_MODEL / "grid.yaml"), str(FLOW_MODEL), (), 2, {"hidden": 4})
    request = StepRequest(spec, "train", 0, 40, parent_run_id="p", experiment_id="e")
    outcome: list[BaseException] = []

    def wait_for_the_step() -> None:
        try:
            steps.submit_step(request)
        except BaseException as err:
            outcome.append(err)

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False) as cluster:
        client = Client(cluster)
        waiter = threading.Thread(target=wait_for_the_step, daemon=True)
        waiter.start()
        time.sleep(1.0)
        closed_at = time.monotonic()
        client.close()
        waiter.join(timeout=steps.WATCH_INTERVAL_S + 5)
        ended_after = time.monotonic() - closed_at
        _LET_GO.set()
    assert not waiter.is_alive(), "the step's waiter still runs after the client closed"
    assert ended_after <= steps.WATCH_INTERVAL_S + 5
    assert len(outcome) == 1 and isinstance(outcome[0], steps.StepAbandoned), outcome
    assert str(outcome[0]) == (
        "step train of trial 2 (batches 0..40) was still running when the flow closed its "
        "Dask client: the flow is ending, and its trials' runs end with it"
    )
