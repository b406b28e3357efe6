"""An experiment as the cluster's job queue sees it (cluster.job_queue): its ``resources``
(priority, weight, max_slots, resource_pool), its concurrency, and who submitted it."""

from __future__ import annotations

import getpass
import os
from typing import TYPE_CHECKING, Any

from cluster.fair_share import DEFAULT_PRIORITY
from cluster.pools import DEFAULT_POOL
from det_tasks.errors import ConfigError

if TYPE_CHECKING:  # Dask is imported where a flow needs it: `det` imports this module
    from cluster.job_slots import JobSettings
    from det_tasks.config import ExperimentConfig

__all__ = [
    "USER_ENV",
    "USER_TAG_PREFIX",
    "check_pool",
    "job_fields",
    "job_settings",
    "local_user",
    "submitting_user",
    "unknown_pool",
]

USER_ENV = "DET_USER"  # who `det job list` says created a job (Determined's variable)
USER_TAG_PREFIX = "det-user:"  # the flow run's tag naming who ran `det experiment create`


def job_settings(cfg: ExperimentConfig, name: str, concurrency: int, gpus: bool) -> JobSettings:
    """The experiment's job: a trial takes ``slots_per_trial`` GPUs on GPU workers, else one
    worker."""
    from cluster.job_slots import JobSettings

    fields = job_fields(cfg, name, concurrency, submitting_user())
    return JobSettings(
        **fields,
        priority=cfg.resources.priority if cfg.resources.priority is not None else DEFAULT_PRIORITY,
        weight=cfg.resources.weight if cfg.resources.weight is not None else 1.0,
        max_slots=cfg.resources.max_slots,
        need=cfg.resources.slots_per_trial if gpus else 1,
    )


def job_fields(cfg: ExperimentConfig, name: str, concurrency: int, user: str) -> dict[str, Any]:
    """What the queue is told of an experiment whoever tells it (its flow, or ``det
    experiment create`` before the flow starts): its name, user, pool and how many trials
    it runs at once."""
    return {
        "name": name,
        "user": user,
        "pool": cfg.resources.resource_pool or DEFAULT_POOL,
        "max_trials": concurrency,
        # What its worker jobs ask Slurm for, where workers are Slurm jobs.
        "slurm": cfg.slurm.model_dump() if cfg.slurm is not None else None,
    }


def submitting_user() -> str:
    """Who submitted the flow run: its ``det-user:`` tag (``det experiment create`` adds
    it), else the user of this process (local_user)."""
    from prefect.runtime import flow_run

    for tag in flow_run.get_tags() or []:
        if tag.startswith(USER_TAG_PREFIX):
            return tag[len(USER_TAG_PREFIX) :]
    return local_user()


def local_user() -> str:
    """DET_USER (Determined's variable), else this process's OS user."""
    return os.environ.get(USER_ENV) or getpass.getuser()


def check_pool(pools: dict[str, int], pool: str) -> None:
    """Refuse a resource_pool the cluster does not have, listing the ones it has."""
    if pool not in pools:
        raise ConfigError(unknown_pool(pool, pools))


def unknown_pool(pool: str, pools: dict[str, int]) -> str:
    known = ", ".join(f"{name} ({slots} slot(s))" for name, slots in pools.items()) or "none"
    return (
        f"resources.resource_pool {pool!r} is not a pool of this cluster; its pools: {known} "
        "(a worker joins pool NAME with `dask worker ... --resources pool-NAME=1`)"
    )
