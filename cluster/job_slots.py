"""An experiment flow's seat in the cluster's job queue (cluster.job_queue): at each wake-up
it reports what it runs and what it would start, and learns which trials may start and which
must give way. One RPC to the scheduler per wake-up.

The settings in force come back with each answer and are sent from then on, so a
``det job update`` outlives a scheduler restart: the flows' reports rebuild the queue."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from distributed import Client

from cluster.job_queue import JOB_QUEUE_NAME, JobQueue
from cluster.pools import DEFAULT_POOL, POOL_RESOURCE_PREFIX, worker_pool

__all__ = [
    "JobSettings",
    "JobSlots",
    "Turn",
    "cluster_pools",
    "pool_resource",
    "register_job_queue",
]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What the queue needs to know about an experiment (its config's ``resources``)."""

    name: str
    user: str
    pool: str = DEFAULT_POOL
    priority: int = 42
    weight: float = 1.0
    max_slots: int | None = None
    need: int = 1
    max_trials: int = 1


@dataclasses.dataclass(frozen=True)
class Turn:
    """One answer: trials that may start now, trials to preempt, why the rest wait."""

    grants: list[int]
    preempt: list[int]
    reason: str


class JobSlots:
    """The experiment's requests to the queue, through the flow's Dask client."""

    def __init__(self, client: Client, key: str, settings: JobSettings) -> None:
        self.client = client
        self.key = key
        self.report: dict[str, Any] = {**dataclasses.asdict(settings), "client": client.id}

    def sync(self, waiting: list[int], running: list[int]) -> Turn:
        """Report and learn (re-registering the queue once if the scheduler restarted and
        lost it)."""
        try:
            answer = self._call("det_jobs_sync", waiting=waiting, running=running)
        except KeyError:
            register_job_queue(self.client)
            answer = self._call("det_jobs_sync", waiting=waiting, running=running)
        self.report.update(answer["settings"])
        return Turn(list(answer["grants"]), list(answer["preempt"]), str(answer["reason"]))

    def end(self, paused: bool) -> None:
        """The flow ends: a paused experiment stays listed until it is activated."""
        try:
            self._call("det_jobs_end", paused=paused)
        except Exception as err:  # the scheduler is gone: so is the queue
            _logger.debug("job queue: could not end job %s: %s", self.key, err)

    def _call(self, op: str, **kwargs: Any) -> Any:
        handler = getattr(self.client.scheduler, op)
        if op == "det_jobs_sync":
            kwargs["job"] = self.report
        answer = self.client.sync(handler, key=self.key, **kwargs)
        if answer is None and op == "det_jobs_sync":  # a scheduler without the queue
            raise KeyError(op)
        return answer


def register_job_queue(client: Client) -> None:
    """Install the job queue on the client's scheduler, once (idempotent: every flow asks,
    the first one's queue stays)."""
    client.register_plugin(JobQueue(), name=JOB_QUEUE_NAME)


def cluster_pools(client: Client) -> dict[str, int] | None:
    """Each resource pool of the client's cluster and its slots; None where the scheduler
    cannot run the queue (it cannot import this package: an operator's plain ``dask
    scheduler``), which the flow then does without."""
    scheduler: Any = client.scheduler
    try:
        pools: dict[str, int] | None = client.sync(scheduler.det_jobs_pools)
        if pools is None:  # a scheduler without the queue (restarted since it was installed)
            register_job_queue(client)
            pools = client.sync(scheduler.det_jobs_pools)
    except Exception as err:  # the plugin failed to unpickle or start there
        _logger.warning("job queue: not available on the scheduler (%s)", err)
        return None
    return None if pools is None else dict(pools)


def pool_resource(client: Client, pool: str) -> str | None:
    """The Dask resource a step of ``pool`` asks for (``pool-<name>``) where the cluster's
    workers form several pools; None where they form one (every worker may take it, named
    or not)."""
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    pools = {worker_pool(w.get("resources", {})) for w in workers}
    return POOL_RESOURCE_PREFIX + pool if len(pools) > 1 else None
