"""``det job list``, ``det job update``, ``det experiment set priority|weight|max-slots``,
the pool check and the queueing of ``det experiment create``, and the end of a paused
experiment: one HTTP request each to the job queue's routes on the stack's Dask scheduler
(cluster.queue_http), with the standard library only. No Dask import: the ``det`` command
stays quick (importing ``distributed`` took 2.2 s of a 2.4 s ``det job list``).

The routes are served on the scheduler's HTTP (dashboard) port: ``DET_TASKS_DASK_HTTP``
(``http://host:port``) where it is set, else the port after the scheduler's, Dask's own
pairing (8786, 8787) and the stack's (infra/dask_cluster.py)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

__all__ = [
    "HTTP_ENV",
    "cluster_pools_at",
    "forget_job",
    "http_address",
    "list_jobs",
    "queue_job",
    "request_stop",
    "update_job",
]

HTTP_ENV = "DET_TASKS_DASK_HTTP"
TIMEOUT_S = 10.0


def http_address(scheduler: str) -> str:
    """The scheduler's HTTP server: ``DET_TASKS_DASK_HTTP``, else ``tcp://host:port``'s
    host at port + 1."""
    explicit = os.environ.get(HTTP_ENV)
    if explicit:
        return explicit.rstrip("/")
    host, _, port = scheduler.removeprefix("tcp://").rpartition(":")
    return f"http://{host}:{int(port) + 1}"


def list_jobs(address: str) -> list[dict[str, Any]]:
    """The queue's jobs in the order they are served (cluster.job_queue.JobQueue.list_jobs).
    Raises OSError when the scheduler cannot be reached."""
    jobs: list[dict[str, Any]] = _call(address, "GET", "/det-tasks/jobs")
    return jobs


def update_job(address: str, key: str, **settings: Any) -> dict[str, Any]:
    """Change a job's priority, weight or max_slots; ``{"error": ...}`` if ``key`` names no
    single job."""
    answer: dict[str, Any] = _call(address, "PATCH", f"/det-tasks/jobs/{key}", settings)
    return answer


def queue_job(address: str, key: str, job: dict[str, Any]) -> dict[str, Any]:
    """Queue a just-created experiment before its flow starts (JobQueue.preregister)."""
    answer: dict[str, Any] = _call(address, "POST", "/det-tasks/jobs", {"key": key, "job": job})
    return answer


def forget_job(address: str, key: str) -> None:
    """Take a paused experiment that was canceled or killed off the queue's list."""
    _call(address, "DELETE", f"/det-tasks/jobs/{key}")


def request_stop(address: str, key: str, mode: str) -> str | None:
    """Leave ``mode`` (pause, cancel, kill) where the experiment's flow reads it; the mode
    that was there before (None: none)."""
    answer: dict[str, Any] = _call(address, "PUT", f"/det-tasks/stop/{key}", {"mode": mode})
    before = answer.get("before")
    return str(before) if before is not None else None


def cluster_pools_at(address: str) -> dict[str, int]:
    """Each resource pool of the cluster at ``address`` and its slots."""
    pools: dict[str, int] = _call(address, "GET", "/det-tasks/pools")
    return pools


def _call(scheduler: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One request; OSError when nothing answers, RuntimeError when the scheduler answers
    without the queue's routes (a plain ``dask scheduler``) or refuses the request."""
    url = http_address(scheduler) + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        if err.code == 404:
            raise RuntimeError(
                f"{url} is not served: start the scheduler with cluster.queue_http in Dask's "
                "distributed.scheduler.http.routes (make up does), or set "
                f"{HTTP_ENV} to its HTTP address"
            ) from None
        raise RuntimeError(f"{method} {url}: HTTP {err.code} {_error_of(err)}") from None


def _error_of(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(err).get("error", err.reason))
    except (ValueError, AttributeError, OSError):
        return str(err.reason)
