"""An experiment flow's seat in the cluster: its chains on its resource pool's workers,
with a place in the job queue, after the checks that must pass before any trial (the pool
exists; Slurm accepts its worker jobs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from cluster.pools import DEFAULT_POOL
from det_tasks.config import ExperimentConfig
from det_tasks.config.experiment_name import experiment_name
from det_tasks.errors import ConfigError
from flows.job_settings import check_pool, job_settings

if TYPE_CHECKING:
    from cluster.placement import Placement
    from flows.chains import TrialChains

__all__ = ["check_slurm_jobs", "queued_chains"]


def queued_chains(
    chains: Callable[[Placement], TrialChains],
    client: Any,
    cfg: ExperimentConfig,
    run_key: str,
    limit: int,
) -> TrialChains:
    """The experiment's chains on its resource pool's workers, with a seat in the
    cluster's job queue (cluster.job_queue) that decides when each trial starts."""
    from cluster.job_slots import JobSlots, cluster_pools, pool_resource, workers_on_demand
    from cluster.placement import Placement

    pools = cluster_pools(client)
    if pools is None:
        get_run_logger().warning(
            "the Dask scheduler cannot run the job queue (install det-tasks where it runs): "
            "this experiment shares its workers first come, first served"
        )
        return chains(Placement(client, run_key))
    pool = cfg.resources.resource_pool or DEFAULT_POOL
    check_pool(pools, pool)  # before any trial: the config names a pool that is not there
    check_slurm_jobs(client, cfg)
    placement = Placement(client, run_key, pool, on_demand=workers_on_demand(client, pool))
    trials = chains(placement)
    name = experiment_name(cfg.name, trials.config_path)
    trials.queue = JobSlots(client, run_key, job_settings(cfg, name, limit, placement.gpus))
    trials.pool_resource = pool_resource(pools, pool)
    return trials


def check_slurm_jobs(client: Any, cfg: ExperimentConfig) -> None:
    """Where workers are Slurm jobs, Slurm's refusal of this experiment's worker jobs
    fails it before any trial (``sbatch --test-only``); a ``slurm:`` section elsewhere
    is said to have no effect."""
    from cluster.slurm_workers import check_slurm

    section = cfg.slurm.model_dump() if cfg.slurm is not None else None
    on_slurm, refused = check_slurm(client, section)
    if refused:
        raise ConfigError(f"slurm: {refused}")
    if not on_slurm and section is not None:
        get_run_logger().warning(
            "`slurm:` has no effect here: this cluster's workers are not Slurm jobs "
            "(docs/operations/slurm.md)"
        )
