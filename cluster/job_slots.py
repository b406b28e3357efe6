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
from cluster.pools import DEFAULT_POOL, POOL_RESOURCE_PREFIX

__all__ = [
    "JobSettings",
    "JobSlots",
    "Turn",
    "cluster_pools",
    "pool_resource",
    "register_job_queue",
    "workers_on_demand",
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
    slurm: dict[str, Any] | None = None  # the config's `slurm:` (cluster.slurm_workers)


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
        """Report and learn."""
        answer = _ask(
            self.client, "det_jobs_sync", key=self.key, job=self.report, waiting=waiting,
            running=running,
        )  # fmt: skip
        self.report.update(answer["settings"])
        return Turn(list(answer["grants"]), list(answer["preempt"]), str(answer["reason"]))

    def end(self, paused: bool) -> None:
        """The flow ends: a paused experiment stays listed until it is activated."""
        try:
            _ask(self.client, "det_jobs_end", key=self.key, paused=paused)
        except Exception as err:  # the scheduler is gone: so is the queue
            _logger.debug("job queue: could not end job %s: %s", self.key, err)


def _ask(client: Client, op: str, **kwargs: Any) -> Any:
    """One call to the queue's handler ``op``. Every handler answers something, so None
    means a scheduler without the queue (restarted since it was installed): it is
    installed again and asked once more."""
    handler = getattr(client.scheduler, op)
    answer = client.sync(handler, **kwargs)
    if answer is None:
        register_job_queue(client)
        answer = client.sync(handler, **kwargs)
    return answer


def register_job_queue(client: Client) -> None:
    """Install the job queue on the client's scheduler, once (idempotent: every flow asks,
    the first one's queue stays)."""
    client.register_plugin(JobQueue(), name=JOB_QUEUE_NAME)


def cluster_pools(client: Client) -> dict[str, int] | None:
    """Each resource pool of the client's cluster and its slots; None where the scheduler
    cannot run the queue (it cannot import this package: an operator's plain ``dask
    scheduler``), which the flow then does without (and says so)."""
    try:
        pools = _ask(client, "det_jobs_pools")
    except Exception as err:  # the plugin failed to unpickle or start there
        _logger.debug("job queue: not available on the scheduler (%s)", err)
        return None
    return None if pools is None else dict(pools)


def workers_on_demand(client: Client, pool: str) -> bool:
    """Whether a plugin on the scheduler starts ``pool``'s workers when the queue wants
    them (its ``elastic_pool``: cluster.slurm_workers), so an experiment offers the queue
    every trial it may run at once, not one per worker there is."""
    return bool(client.run_on_scheduler(_starts_workers_for, pool=pool))


def _starts_workers_for(dask_scheduler: Any, pool: str) -> bool:
    plugins = dask_scheduler.plugins.values()
    return any(getattr(plugin, "elastic_pool", None) == pool for plugin in plugins)


def pool_resource(pools: dict[str, int], pool: str) -> str | None:
    """The Dask resource a step of ``pool`` asks for (``pool-<name>``) where the cluster's
    workers form several ``pools`` (cluster_pools); None where they form one (every worker
    may take it, named or not)."""
    return POOL_RESOURCE_PREFIX + pool if len(pools) > 1 else None
