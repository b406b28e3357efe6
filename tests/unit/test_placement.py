"""Where trials start on a real (in-process) Dask cluster. Two experiments' flows place
their first trial at the same moment, before either step has reached a worker: each flow
alone sees two idle workers, and both used to pin their trial to the first one, so one
trial queued behind the other for its whole length while the second worker stood idle (a
CI run's test_submit: 5 minutes). Given every suitable worker, Dask starts each step on the
least busy one."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.integration.helpers import FLOW_MODEL, wait_for

_LET_GO = threading.Event()


def _hold(_: Any) -> None:
    _LET_GO.wait(30)


def _request(experiment_key: str, trial_id: int) -> Any:
    from cluster.held_trials import StepRequest
    from det_tasks.runner.held import TrialSpec

    spec = TrialSpec(
        str(FLOW_MODEL / "grid.yaml"), str(FLOW_MODEL), (), trial_id, {"hidden": 4},
        experiment_run_key=experiment_key,
    )  # fmt: skip
    return StepRequest(spec, "train", 0, 40, parent_run_id="p", experiment_id="e")


def placement_of(client: Any) -> dict[str, str]:
    """Each processing step's worker, by key."""
    return {key: w for w, keys in client.processing().items() for key in keys}


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> Any:
    from distributed import Client, LocalCluster

    import cluster.steps as steps

    monkeypatch.setattr(steps, "run_step", _hold)
    _LET_GO.clear()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client
        _LET_GO.set()


def test_two_experiments_placing_at_once_start_on_different_workers(two_workers: Any) -> None:
    from cluster.placement import Placement
    from cluster.steps import _submit

    client = two_workers
    first, second = Placement(client, "experiment-a"), Placement(client, "experiment-b")
    choices = [first.claim(1), second.claim(1)]  # both before either step is submitted
    workers = sorted(client.scheduler_info()["workers"])
    assert [sorted(c or []) for c in choices] == [workers, workers]
    futures = [
        _submit(client, _request(key, 1), where, 0)
        for key, where in zip(["experiment-a", "experiment-b"], choices, strict=True)
    ]

    def running_on() -> dict[str, Any]:
        return {w: keys for w, keys in client.processing().items() if keys}

    wait_for(lambda: len(running_on()) == 2, 10, "each step on a worker of its own")
    assert sorted(len(keys) for keys in running_on().values()) == [1, 1]
    _LET_GO.set()
    client.gather(futures)


def test_a_trial_returns_to_its_worker_and_a_new_one_goes_where_none_is_held(
    two_workers: Any,
) -> None:
    from cluster.placement import Placement

    client = two_workers
    placement = Placement(client, "experiment-a")
    held_on, other = placement.workers()
    placement.ran(1, held_on)
    placement.done(1)  # trial 1's segment ended; its worker still holds it
    assert placement.claim(2) == [other]  # not onto trial 1's worker while another is free
    assert placement.claim(1) == [held_on]  # trial 1 goes home, warm
    assert placement.claim(3) is None  # every worker claimed: Dask chooses
    placement.ran(2, other)
    for trial in (1, 2):
        placement.done(trial)
    # Both workers hold a trial of this experiment: a new trial takes one of them, and the
    # trial held there goes to the other rather than queue behind it.
    (evicted,) = placement.claim(4) or []
    assert evicted in (held_on, other)
    assert placement.claim(1) == [other if evicted == held_on else held_on]


def test_a_new_trial_is_not_pinned_to_the_worker_an_unsettled_trial_went_to(
    two_workers: Any,
) -> None:
    """Trials 1 and 2 start together, each offered both workers. Trial 1's segment ends
    while trial 2 still trains: trial 3 goes to trial 1's worker, not onto trial 2's (a CI
    run's test_shared_stack: pinned there, the two evicted each other at every step)."""
    from cluster.placement import Placement
    from cluster.steps import _submit

    client = two_workers
    placement = Placement(client, "experiment-a")
    offers = [placement.claim(1), placement.claim(2)]
    workers = sorted(client.scheduler_info()["workers"])
    assert [sorted(o or []) for o in offers] == [workers, workers]
    # Neither step is on the scheduler yet: a third trial may not be pinned to either alone.
    assert sorted(placement.claim(3) or []) == workers
    placement.done(3)
    futures = {t: _submit(client, _request("experiment-a", t), offers[t - 1], 0) for t in (1, 2)}
    wait_for(lambda: len(placement_of(client)) == 2, 10, "each step on a worker of its own")
    where = placement_of(client)
    placement.ran(1, where[futures[1].key])
    placement.done(1)  # trial 1's segment ended; trial 2 is still training
    assert placement.claim(3) == [where[futures[1].key]]
    _LET_GO.set()
    client.gather(list(futures.values()))


def test_a_trial_queued_behind_another_keeps_its_worker_claimed(two_workers: Any) -> None:
    """Trials 1 and 2, each offered both workers, both go to the first one (the second
    was busy with another experiment's step). Trial 1 is stopped; trial 2, still there,
    keeps that worker: a new trial is not sent onto it."""
    from cluster.placement import Placement
    from cluster.steps import _submit

    client = two_workers
    placement = Placement(client, "experiment-a")
    first, second = placement.workers()
    assert [sorted(placement.claim(t) or []) for t in (1, 2)] == [sorted([first, second])] * 2
    futures = [_submit(client, _request("experiment-a", t), [first], 0) for t in (1, 2)]
    wait_for(lambda: len(placement_of(client)) == 2, 10, "both steps given the first worker")
    assert placement.claim(3) == [second]  # settles trial 1 on the first worker; 2 waits
    placement.done(3)
    placement.done(1)  # trial 1 stopped (no segment result: it holds nothing now)
    assert placement.claim(4) == [second]
    _LET_GO.set()
    client.gather(futures)


def test_a_released_trials_worker_takes_the_next_trial_before_a_held_ones(
    two_workers: Any,
) -> None:
    """Trial 1 ended and was released on one worker; trial 2 is still held on the other.
    A new trial goes to the worker that holds nothing now, not onto trial 2's (which would
    evict it)."""
    from cluster.placement import Placement

    client = two_workers
    placement = Placement(client, "experiment-a")
    held, freed = placement.workers()  # the order Placement itself lists them in
    placement.ran(2, held)
    placement.done(2)  # trial 2's segment ended; its worker still holds it
    placement.ran(1, freed)
    placement.done(1)
    placement.released(1)  # trial 1's last checkpoint released it
    assert placement.claim(3) == [freed]


def test_a_trial_placed_beside_another_offered_one_waits_to_see_where_that_one_went(
    two_workers: Any,
) -> None:
    """Trials 1 and 2 start together. Trial 1 is offered both workers and its step reaches
    the scheduler a moment later (its Prefect task starting). Trial 2 waits for that, then
    takes the other worker: offered both as well, Dask started both on one worker in a CI
    run, and the two evicted each other at every step while the other worker stood idle."""
    from cluster.placement import PLACED_WAIT_S, Placement
    from cluster.steps import _submit

    client = two_workers
    placement = Placement(client, "experiment-a")
    workers = sorted(client.scheduler_info()["workers"])
    offer = placement.claim(1)
    assert sorted(offer or []) == workers
    submitted: list[Any] = []
    timer = threading.Timer(
        PLACED_WAIT_S / 5,
        lambda: submitted.append(_submit(client, _request("experiment-a", 1), offer, 0)),
    )
    timer.start()
    try:
        second = placement.claim(2)
        wait_for(lambda: len(placement_of(client)) == 1, 10, "trial 1's step on a worker")
        (went_to,) = placement_of(client).values()
        assert second == [w for w in workers if w != went_to]
    finally:
        timer.join()
        _LET_GO.set()
        client.gather(submitted)
