"""``det job list``, ``det job update``, ``det experiment set priority|weight|max-slots`` and
the pool check of ``det experiment create``: one RPC each to the scheduler's job queue
(cluster.job_queue), without a Dask client of their own, as ``det experiment pause`` leaves
its stop request. A scheduler that no flow has used yet gets the queue installed first.
Dask is imported only when a call needs it: the ``det`` command stays quick."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cluster_pools_at", "forget_job", "list_jobs", "update_job"]


def list_jobs(address: str) -> list[dict[str, Any]]:
    """The queue's jobs in the order they are served (cluster.job_queue.JobQueue.list_jobs).
    Raises OSError when the scheduler cannot be reached."""
    jobs: list[dict[str, Any]] = _call(address, "det_jobs_list")
    return jobs


def update_job(address: str, key: str, **settings: Any) -> dict[str, Any]:
    """Change a job's priority, weight or max_slots; ``{"error": ...}`` if ``key`` names no
    single job."""
    answer: dict[str, Any] = _call(address, "det_jobs_update", key=key, **settings)
    return answer


def forget_job(address: str, key: str) -> None:
    """Take a paused experiment that was canceled or killed off the queue's list."""
    _call(address, "det_jobs_end", key=key, paused=False)


def cluster_pools_at(address: str) -> dict[str, int]:
    """Each resource pool of the cluster at ``address`` and its slots."""
    pools: dict[str, int] = _call(address, "det_jobs_pools")
    return pools


def _call(address: str, op: str, **kwargs: Any) -> Any:
    from distributed.core import rpc

    async def exchange() -> Any:
        async with rpc(address, timeout=10) as scheduler:
            answer = await getattr(scheduler, op)(**kwargs)
            if answer is None:  # no queue on this scheduler yet (every handler answers)
                await _install(scheduler)
                answer = await getattr(scheduler, op)(**kwargs)
            return answer

    return asyncio.run(exchange())


async def _install(scheduler: Any) -> None:
    from distributed.protocol.pickle import dumps

    from cluster.job_queue import JOB_QUEUE_NAME, JobQueue

    await scheduler.register_scheduler_plugin(
        plugin=dumps(JobQueue()), name=JOB_QUEUE_NAME, idempotent=True
    )
