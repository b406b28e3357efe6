"""The job queue's state on the scheduler (cluster.job_queue.JobQueue), driven through its
handlers as flows and `det job` call them; the scheduler stands in as its worker table
(the integration test, tests/integration/test_job_queue.py, runs it on the stack's)."""

from __future__ import annotations

import asyncio
import types

import pytest

from cluster.job_queue import JobQueue
from cluster.pools import worker_pool


def _queue(*resources: dict[str, float]) -> JobQueue:
    queue = JobQueue()
    workers = {f"w{i}": types.SimpleNamespace(resources=r) for i, r in enumerate(resources)}
    scheduler = types.SimpleNamespace(workers=workers, handlers={}, plugins={})
    asyncio.run(queue.start(scheduler))  # type: ignore[arg-type]
    return queue


def _job(name: str, **settings: object) -> dict[str, object]:
    return {"name": name, "user": "ana", "pool": "default", "need": 1, "max_trials": 4,
            "client": f"client-{name}", **settings}  # fmt: skip


def test_the_handlers_are_registered_on_the_scheduler() -> None:
    queue = _queue({})
    assert queue.scheduler is not None
    handlers = queue.scheduler.handlers  # type: ignore[attr-defined]
    assert {"det_jobs_sync", "det_jobs_end", "det_jobs_list", "det_jobs_update",
            "det_jobs_pools"} <= set(handlers)  # fmt: skip


def test_a_second_experiment_waits_with_its_reason_then_gets_the_next_slot() -> None:
    queue = _queue({}, {})
    first = queue.sync("aaaa1111", _job("grid"), waiting=[1, 2, 3], running=[])
    assert first["grants"] == [1, 2]
    second = queue.sync("bbbb2222", _job("const"), waiting=[1], running=[])
    assert second["grants"] == []
    assert second["reason"] == (
        "waiting for a slot: 1 experiment(s) ahead at priority 42 or more urgent"
    )
    rows = {row["name"]: row for row in queue.list_jobs()}
    assert (rows["grid"]["state"], rows["grid"]["held"], rows["grid"]["wanted"]) == (
        "SCHEDULED", 2, 3)  # fmt: skip
    assert (rows["const"]["state"], rows["const"]["position"]) == ("QUEUED", 1)
    # The grid's trial 1 ends: its slot goes to the experiment holding none, not to trial 3.
    assert queue.sync("aaaa1111", _job("grid"), waiting=[3], running=[2])["grants"] == []
    assert queue.sync("bbbb2222", _job("const"), waiting=[1], running=[])["grants"] == [1]


def test_an_update_wins_over_the_config_and_comes_back_to_the_flow() -> None:
    queue = _queue({})
    queue.sync("aaaa1111", _job("grid"), waiting=[1], running=[])
    answer = queue.update("aaaa", priority=5, weight=2.0, ignored=1)
    assert answer == {"key": "aaaa1111", "settings": {"priority": 5, "weight": 2.0,
                                                      "max_slots": None}}  # fmt: skip
    again = queue.sync("aaaa1111", _job("grid", priority=42), waiting=[], running=[1])
    assert again["settings"]["priority"] == 5
    assert "error" in queue.update("zzzz", priority=1)


def test_a_raise_preempts_a_less_urgent_trial_once_it_has_run_the_minimum() -> None:
    queue = _queue({})
    queue.min_runtime_s = 0.0
    queue.sync("aaaa1111", _job("holder"), waiting=[1], running=[])
    queue.sync("bbbb2222", _job("urgent"), waiting=[1], running=[])
    queue.update("bbbb", priority=1)
    assert queue.sync("bbbb2222", _job("urgent"), waiting=[1], running=[])["grants"] == []
    assert queue.sync("aaaa1111", _job("holder"), waiting=[], running=[1])["preempt"] == [1]
    # The holder checkpointed and gave its slot up: the urgent trial gets it, not the holder.
    assert queue.sync("aaaa1111", _job("holder"), waiting=[1], running=[])["grants"] == []
    assert queue.sync("bbbb2222", _job("urgent"), waiting=[1], running=[])["grants"] == [1]


def test_a_paused_job_stays_listed_a_gone_flows_job_does_not() -> None:
    queue = _queue({})
    queue.sync("aaaa1111", _job("paused"), waiting=[], running=[1])
    queue.sync("bbbb2222", _job("crashed"), waiting=[1], running=[])
    queue.end("aaaa1111", paused=True)
    queue.remove_client(None, "client-crashed")  # type: ignore[arg-type]
    queue.remove_client(None, "client-paused")  # type: ignore[arg-type]
    (row,) = queue.list_jobs()
    assert (row["name"], row["state"], row["held"]) == ("paused", "PAUSED", 0)
    queue.end("aaaa1111")  # killed while paused
    assert queue.list_jobs() == []


@pytest.mark.parametrize(
    ("resources", "pool"),
    [({}, "default"), ({"GPU": 1}, "default"), ({"pool-gpu": 1, "GPU": 2}, "gpu")],
)
def test_a_workers_pool_is_its_pool_resource(resources: dict, pool: str) -> None:
    assert worker_pool(resources) == pool


def test_pools_count_workers_or_their_gpus() -> None:
    queue = _queue({}, {"pool-gpu": 1, "GPU": 2}, {"pool-gpu": 1, "GPU": 2})
    assert queue.pools() == {"default": 1, "gpu": 4}


def test_an_unknown_pool_is_refused_in_one_line_that_lists_the_pools() -> None:
    from det_tasks.errors import ConfigError
    from flows.job_settings import check_pool

    check_pool({"default": 2, "gpu": 4}, "gpu")  # known: nothing to say
    with pytest.raises(ConfigError) as refused:
        check_pool({"default": 2, "gpu": 4}, "tpu")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "resources.resource_pool 'tpu' is not a pool of this cluster; its pools: "
        "default (2 slot(s)), gpu (4 slot(s))"
    )


def test_an_experiment_queued_at_create_takes_the_next_freed_slot_before_the_grid() -> None:
    queue = _queue({}, {})
    assert queue.sync("aaaa1111", _job("grid"), waiting=[1, 2, 3, 4], running=[])["grants"] == [
        1, 2]  # fmt: skip
    queued = queue.preregister("bbbb2222", {"name": "single", "user": "bo", "max_trials": 1,
                                            "priority": 42, "weight": 1.0})  # fmt: skip
    assert queued == {"key": "bbbb2222", "new": True,
                      "settings": {"priority": 42, "weight": 1.0, "max_slots": None}}  # fmt: skip
    rows = {row["name"]: row for row in queue.list_jobs()}
    assert (rows["single"]["state"], rows["single"]["wanted"], rows["single"]["user"]) == (
        "QUEUED", 1, "bo")  # fmt: skip
    # The grid's trial 1 ends while the newcomer's flow is still starting: the slot is kept.
    assert queue.sync("aaaa1111", _job("grid"), waiting=[3, 4], running=[2])["grants"] == []
    # Its flow's first report takes the same entry over and gets the slot.
    first = queue.sync("bbbb2222", _job("single", user="bo"), waiting=[1], running=[])
    assert first["grants"] == [1]
    assert [row["key"] for row in queue.list_jobs()].count("bbbb2222") == 1
    # Queued again (a retried create): left as the flow reported it.
    assert queue.preregister("bbbb2222", {"name": "single"})["new"] is False
    assert queue.jobs["bbbb2222"].running.keys() == {1}


def test_a_queued_experiment_whose_flow_never_reports_gives_its_slots_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster import job_queue

    queue = _queue({})
    clock = [1000.0]
    monkeypatch.setattr(job_queue.time, "monotonic", lambda: clock[0])
    queue.preregister("bbbb2222", {"name": "never-starts", "max_trials": 1})
    assert queue.sync("aaaa1111", _job("grid"), waiting=[1], running=[])["grants"] == []
    clock[0] += job_queue.STALE_AFTER_S + 1
    assert queue.sync("aaaa1111", _job("grid"), waiting=[1], running=[])["grants"] == [1]
    assert [row["name"] for row in queue.list_jobs()] == ["grid"]


def test_a_queued_experiment_takes_slots_per_trial_gpus_only_in_a_gpu_pool() -> None:
    queue = _queue({"pool-gpu": 1, "GPU": 4}, {})
    queue.preregister("aaaa1111", {"name": "g", "pool": "gpu", "slots_per_trial": 2})
    queue.preregister("bbbb2222", {"name": "c", "pool": "default", "slots_per_trial": 2})
    assert (queue.jobs["aaaa1111"].need, queue.jobs["bbbb2222"].need) == (2, 1)
