"""The job queue's HTTP routes (cluster.queue_http) on a real Dask scheduler, loaded the way
the stack's scheduler loads them (Dask's ``distributed.scheduler.http.routes``), and reached
by ``det``'s client (cluster.job_requests) with the standard library alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import dask.config
import pytest
from distributed import Scheduler

from cluster import job_requests
from cluster.job_queue import JOB_QUEUE_NAME
from cluster.queue_http import ROUTES_SETTING, route_modules

SCHEDULER = "tcp://127.0.0.1:1"  # its HTTP address comes from DET_TASKS_DASK_HTTP here


def _on_scheduler(
    monkeypatch: pytest.MonkeyPatch, calls: Callable[[Scheduler], Any], routes: list[str]
) -> Any:
    """``calls(scheduler)`` in a thread while a scheduler with ``routes`` serves HTTP."""

    async def serve() -> Any:
        with dask.config.set({ROUTES_SETTING: routes}):
            async with Scheduler(port=0, dashboard_address="127.0.0.1:0") as scheduler:
                monkeypatch.setenv(
                    job_requests.HTTP_ENV, f"http://127.0.0.1:{scheduler.http_server.port}"
                )
                return await asyncio.to_thread(calls, scheduler)

    return asyncio.run(serve())


def test_det_reads_and_changes_the_queue_over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    def calls(scheduler: Scheduler) -> None:
        # No flow has installed the queue: the route installs it and answers.
        assert JOB_QUEUE_NAME not in scheduler.plugins
        assert job_requests.list_jobs(SCHEDULER) == []
        assert JOB_QUEUE_NAME in scheduler.plugins
        assert job_requests.cluster_pools_at(SCHEDULER) == {}
        job = {"name": "single", "user": "ana", "max_trials": 1, "priority": 7, "weight": 2.0}
        queued = job_requests.queue_job(SCHEDULER, "bbbb2222-key", job)
        assert queued["new"] is True and queued["settings"]["priority"] == 7
        (row,) = job_requests.list_jobs(SCHEDULER)
        assert (row["key"], row["name"], row["state"], row["priority"], row["weight"]) == (
            "bbbb2222-key", "single", "QUEUED", 7, 2.0)  # fmt: skip
        # The flow's first report (through Dask's RPC handler) takes the same entry over.
        queue = scheduler.plugins[JOB_QUEUE_NAME]
        queue.sync("bbbb2222-key", {**job, "client": "c1"}, waiting=[1], running=[])
        assert [r["key"] for r in job_requests.list_jobs(SCHEDULER)] == ["bbbb2222-key"]
        changed = job_requests.update_job(SCHEDULER, "bbbb", priority=3)
        assert changed["key"] == "bbbb2222-key"
        assert changed["settings"] == {"priority": 3, "weight": 2.0, "max_slots": None}
        assert "error" in job_requests.update_job(SCHEDULER, "zzzz", weight=1.0)
        job_requests.forget_job(SCHEDULER, "bbbb2222-key")
        assert job_requests.list_jobs(SCHEDULER) == []

    _on_scheduler(monkeypatch, calls, route_modules())


def test_a_bad_body_is_a_400_naming_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def calls(scheduler: Scheduler) -> str:
        with pytest.raises(RuntimeError) as refused:
            job_requests._call(SCHEDULER, "POST", "/det-tasks/jobs", {"key": "k"})
        return str(refused.value)

    message = _on_scheduler(monkeypatch, calls, route_modules())
    assert "HTTP 400" in message and "lacks ['job']" in message


def test_a_scheduler_without_the_routes_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def calls(scheduler: Scheduler) -> str:
        with pytest.raises(RuntimeError) as refused:
            job_requests.list_jobs(SCHEDULER)
        return str(refused.value)

    message = _on_scheduler(monkeypatch, calls, list(dask.config.get(ROUTES_SETTING)))
    assert "cluster.queue_http" in message and "distributed.scheduler.http.routes" in message


def test_the_http_address_is_the_port_after_the_schedulers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(job_requests.HTTP_ENV, raising=False)
    assert job_requests.http_address("tcp://10.0.0.5:28786") == "http://10.0.0.5:28787"


def test_the_det_side_imports_no_dask() -> None:
    code = (
        "import sys, cluster.job_requests, det_cli.job_verbs, det_cli.dispatch; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_det_leaves_a_stop_request_over_http_where_the_flow_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``det experiment pause|cancel|kill`` (cluster.stop_requests.request_stop_at): one HTTP
    request, the mode left in the scheduler's metadata the flow reads, the mode before
    returned (so a repeated pause is said to be one)."""
    from cluster.stop_requests import request_stop_at, stop_metadata_key

    def calls(scheduler: Scheduler) -> None:
        where = stop_metadata_key("cccc3333-key")
        assert request_stop_at(SCHEDULER, "cccc3333-key", "pause") is None
        assert scheduler.get_metadata(keys=where, default=None) == "pause"
        assert request_stop_at(SCHEDULER, "cccc3333-key", "pause") == "pause"
        assert request_stop_at(SCHEDULER, "cccc3333-key", "kill") == "pause"
        assert scheduler.get_metadata(keys=where, default=None) == "kill"
        with pytest.raises(RuntimeError, match="mode 'stop' is not one of"):
            job_requests.request_stop(SCHEDULER, "cccc3333-key", "stop")

    _on_scheduler(monkeypatch, calls, route_modules())


def test_a_scheduler_without_the_routes_gets_the_stop_request_by_rpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain ``dask scheduler`` (Dask's own routes only) answers 404: the request falls
    back to Dask's RPC, and the flow finds the same mode in the same place."""
    from cluster.stop_requests import request_stop_at, stop_metadata_key

    def calls(scheduler: Scheduler) -> None:
        assert request_stop_at(scheduler.address, "dddd4444-key", "cancel") is None
        where = stop_metadata_key("dddd4444-key")
        assert scheduler.get_metadata(keys=where, default=None) == "cancel"

    _on_scheduler(monkeypatch, calls, list(dask.config.get(ROUTES_SETTING)))
