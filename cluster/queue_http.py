"""The job queue (cluster.job_queue) over the Dask scheduler's own HTTP server, so ``det job
list|update``, ``det experiment create`` and ``det experiment kill`` reach it with plain HTTP
(cluster.job_requests) and never import Dask (2.2 s of a 2.4 s ``det job list``).

Dask loads these routes itself: the module is named in its setting
``distributed.scheduler.http.routes`` (``route_modules`` gives the list; the stack's
scheduler gets it in its environment, infra/dask_cluster.py), and the scheduler serves them
on its dashboard port beside ``/health``. A route that finds no queue on the scheduler (no
flow has used it since it started) installs one first: the queue is the same plugin the
flows register (idempotent, so the first one stays), and it exists from the first request of
anyone, flow or ``det``, with no preload to keep in step.

- ``GET  /det-tasks/jobs``: the jobs in the order they are served (``det job list``), each
  with ``slurm_jobs``, its workers' Slurm job ids, where workers are Slurm jobs
  (cluster.slurm_workers);
- ``POST /det-tasks/jobs``: ``{"key", "job"}``, an experiment queued at its creation;
- ``PATCH /det-tasks/jobs/KEY``: ``{"priority"|"weight"|"max_slots": value}``;
- ``DELETE /det-tasks/jobs/KEY``: a paused experiment canceled or killed, off the list;
- ``GET  /det-tasks/pools``: each resource pool and its slots;
- ``PUT  /det-tasks/stop/KEY``: ``{"mode": "pause"|"cancel"|"kill"}``, an experiment's stop
  request left where its flow reads it (cluster.stop_requests); answers the mode there before.
"""

from __future__ import annotations

import json
from typing import Any

from distributed import Scheduler
from distributed.http.utils import RequestHandler
from tornado.web import HTTPError

from cluster.job_queue import JOB_QUEUE_NAME, JobQueue
from cluster.slurm_settings import SLURM_WORKERS_NAME
from cluster.stop_requests import STOP_STATES, stop_metadata_key

__all__ = ["JOBS_PATH", "POOLS_PATH", "ROUTES_SETTING", "STOP_PATH", "route_modules", "routes"]

JOBS_PATH = "/det-tasks/jobs"
POOLS_PATH = "/det-tasks/pools"
STOP_PATH = "/det-tasks/stop"
ROUTES_SETTING = "distributed.scheduler.http.routes"


def route_modules() -> list[str]:
    """Dask's own scheduler routes (its defaults here) and this module's."""
    import dask.config

    modules = list(dask.config.get(ROUTES_SETTING))
    return modules if __name__ in modules else [*modules, __name__]


async def job_queue(scheduler: Scheduler) -> JobQueue:
    """The scheduler's queue, installed first if no one has yet."""
    if JOB_QUEUE_NAME not in scheduler.plugins:
        await scheduler.register_scheduler_plugin(JobQueue(), name=JOB_QUEUE_NAME, idempotent=True)
    queue = scheduler.plugins[JOB_QUEUE_NAME]
    assert isinstance(queue, JobQueue), type(queue)
    return queue


class _QueueHandler(RequestHandler):
    """JSON in, JSON out; a body that is not a JSON object is a 400 naming the path."""

    def answer(self, value: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(value))

    def body(self, *required: str) -> dict[str, Any]:
        try:
            value = json.loads(self.request.body or b"{}")
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise HTTPError(400, reason=f"{self.request.path}: the body must be a JSON object")
        missing = [name for name in required if name not in value]
        if missing:
            raise HTTPError(400, reason=f"{self.request.path}: the body lacks {missing}")
        return value

    async def queue(self) -> JobQueue:
        return await job_queue(self.server)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None))[1]
        reason = getattr(error, "reason", None) or (repr(error) if error else self._reason)
        self.answer({"error": reason})


class JobsHandler(_QueueHandler):
    async def get(self) -> None:
        queue = await self.queue()
        rows = queue.list_jobs()
        slurm = self.server.plugins.get(SLURM_WORKERS_NAME)
        if slurm is not None:
            for row in rows:
                job = queue.jobs.get(row["key"])
                row["slurm_jobs"] = slurm.job_ids(row["key"], job.running if job else ())
        self.answer(rows)

    async def post(self) -> None:
        body = self.body("key", "job")
        queue = await self.queue()
        self.answer(queue.preregister(str(body["key"]), dict(body["job"])))


class JobHandler(_QueueHandler):
    async def patch(self, key: str) -> None:
        self.answer((await self.queue()).update(key, **self.body()))

    async def delete(self, key: str) -> None:
        self.answer((await self.queue()).end(key, paused=False))


class PoolsHandler(_QueueHandler):
    async def get(self) -> None:
        self.answer((await self.queue()).pools())


class StopHandler(_QueueHandler):
    def put(self, key: str) -> None:
        mode = self.body("mode")["mode"]
        if mode not in STOP_STATES:
            raise HTTPError(
                400,
                reason=f"{self.request.path}: mode {mode!r} is not one of {sorted(STOP_STATES)}",
            )
        scheduler: Scheduler = self.server
        where: list[Any] = list(stop_metadata_key(key))
        before = scheduler.get_metadata(keys=where, default=None)
        if before != mode:
            scheduler.set_metadata(keys=where, value=mode)
        self.answer({"before": before})


# What Dask's get_handlers reads: (path, handler, its initialize arguments).
routes: list[tuple[str, type, dict[str, Any]]] = [
    (JOBS_PATH, JobsHandler, {}),
    (JOBS_PATH + "/([^/]+)", JobHandler, {}),
    (POOLS_PATH, PoolsHandler, {}),
    (STOP_PATH + "/([^/]+)", StopHandler, {}),
]
