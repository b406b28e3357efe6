"""What a det-tasks Dask worker is, in one place: one step at a time, no Dask memory limit,
non-daemonic, its trials training on ``threads`` CPU threads, seeing only its GPUs and
advertising them and its resource pool as Dask resources.

Two launchers read it: the stack's ``dask worker`` command line (``infra.dask_cluster``,
``cli_args`` and ``cli_env``) and the embedded cluster's Nanny workers (``cluster.startup``,
``nanny_options``, with ``NANNY_SETTINGS`` set). No Dask import: the stack's CLI builds a
command with it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from cluster.pools import POOL_RESOURCE_PREFIX
from det_tasks.cpu_threads import WORKER_THREADS_ENV

__all__ = [
    "NANNY_SETTINGS",
    "QUIET_DIAGNOSTICS",
    "NO_MEMORY_LIMIT",
    "STEPS_AT_ONCE",
    "WORKER_DAEMON_ENV",
    "WorkerSpec",
    "quiet_diagnostics_env",
]

# Dask's default memory limit is the host's RAM / workers, and a worker past 80% of it is
# *paused*: it silently stops running tasks. Our workers hold trials (torch, a model, data
# loaders) in process memory, not Dask data, so 32 workers on 23 GB (0.79 GB each, 0.68 GB
# used) all paused and the experiment hung. Instead, cluster.startup.workers_that_fit
# starts no more embedded workers than the host's available memory holds.
NO_MEMORY_LIMIT = 0
# One step at a time: a worker holds one trial (its Dask thread count).
STEPS_AT_ONCE = 1
# Trials start processes of their own (DataLoader workers, subprocesses), which a daemonic
# worker may not ("daemonic processes are not allowed to have children"). The Nanny reads
# this Dask setting when it starts its worker: set in the process that runs the Nanny (the
# embedded cluster's), or as WORKER_DAEMON_ENV in the ``dask worker`` command's environment.
NANNY_SETTINGS: dict[str, Any] = {"distributed.worker.daemon": False}
WORKER_DAEMON_ENV = "DASK_DISTRIBUTED__WORKER__DAEMON"
# Dask's diagnostics for its dashboard, slowed or off in our schedulers and workers: the
# event-loop tick every 20 ms (now 1 s: a blocked loop is still caught, within a second),
# psutil every 0.5 s (now 5 s) and the statistical profiler every 10 ms (off: the
# dashboard's Profile tab stays empty). An idle stack's Dask processes (a scheduler, two
# nannies and their workers) used 6.1 CPU-seconds in 30 s with them, 1.2 without, and the
# embedded cluster of a 55-s experiment 11 CPU-seconds more (docs/performance.md). The
# environment (DASK_DISTRIBUTED__...) of a stack's commands can turn each back on.
QUIET_DIAGNOSTICS: dict[str, Any] = {
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.worker.profile.enabled": False,
}


def quiet_diagnostics_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """QUIET_DIAGNOSTICS as the environment a ``dask`` command reads, leaving any of them
    ``environ`` (this process's) already sets as it is."""
    quiet = {
        "DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
        for key, value in QUIET_DIAGNOSTICS.items()
    }
    return {name: environ.get(name, value) for name, value in quiet.items()}


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker: ``threads`` for its trials (``DET_TASKS_WORKER_THREADS``); ``gpus`` it
    alone sees (``CUDA_VISIBLE_DEVICES``) and advertises as the resource ``GPU``; ``pool``
    it joins as the resource ``pool-<name>`` (None: none named, the default pool); modules
    it imports at start (``preload``)."""

    threads: int
    gpus: tuple[int, ...] | None = None
    pool: str | None = None
    preload: tuple[str, ...] = ()

    def resources(self) -> dict[str, int]:
        named = {f"{POOL_RESOURCE_PREFIX}{self.pool}": 1} if self.pool is not None else {}
        return named | ({"GPU": len(self.gpus)} if self.gpus else {})

    def env(self) -> dict[str, str]:
        """The worker process's environment additions."""
        own = {WORKER_THREADS_ENV: str(self.threads)}
        if self.gpus is not None:
            own["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return own

    def cli_env(self) -> dict[str, str]:
        """``env`` plus ``NANNY_SETTINGS`` as Dask reads them from the environment."""
        daemon = NANNY_SETTINGS["distributed.worker.daemon"]
        return self.env() | {WORKER_DAEMON_ENV: str(daemon)}

    def cli_args(self) -> list[str]:
        """``dask worker`` options for this worker (one worker process per command)."""
        args = ["--nthreads", str(STEPS_AT_ONCE), "--nworkers", "1"]
        args += ["--memory-limit", str(NO_MEMORY_LIMIT)]
        for module in self.preload:
            args += ["--preload", module]
        resources = self.resources()
        if resources:
            args += ["--resources", " ".join(f"{k}={v}" for k, v in resources.items())]
        return args

    def nanny_options(self) -> dict[str, Any]:
        """``distributed.Nanny`` keyword arguments for this worker (``LocalCluster`` takes
        them too, with ``nthreads`` as ``threads_per_worker``)."""
        options: dict[str, Any] = {
            "nthreads": STEPS_AT_ONCE,
            "memory_limit": NO_MEMORY_LIMIT,
            "env": self.env(),
        }
        if self.resources():
            options["resources"] = self.resources()
        if self.preload:
            options["preload"] = list(self.preload)
        return options
