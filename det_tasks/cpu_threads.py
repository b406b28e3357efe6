"""How many CPU threads a training process gets when several share a host (imports nothing
heavy: the stack's scripts use it to start Dask workers)."""

from __future__ import annotations

import os

from det_tasks.errors import ConfigError

__all__ = [
    "WORKER_THREADS_ENV",
    "available_cores",
    "threads_per_process",
    "worker_share",
    "worker_threads",
]

# The CPU threads a warm Dask worker's trials train on, set per worker by whoever starts it
# (cluster.startup's embedded cluster, infra.dask_cluster); unset: Dask's one thread.
WORKER_THREADS_ENV = "DET_TASKS_WORKER_THREADS"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as under taskset or a
    container's cpuset), not every core of the host."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """CPU threads each of ``processes`` training processes gets out of ``cores`` (default:
    this process's), at least 1: the cores shared out, as a Determined container would have
    them all for one trial."""
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    return max((available_cores() if cores is None else cores) // processes, 1)


def worker_threads() -> int | None:
    """This Dask worker's share of the host's cores (``DET_TASKS_WORKER_THREADS``); None
    outside a worker started with one."""
    text = os.environ.get(WORKER_THREADS_ENV)
    if text is None or text == "":
        return None
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(
            f"{WORKER_THREADS_ENV}={text!r} is not a number of CPU threads: set it to a whole "
            "number of at least 1 (the host's cores divided by its workers), or unset it"
        )
    return threads


def worker_share(workers: int) -> int:
    """The CPU threads each of ``workers`` warm workers started here trains on: a
    ``DET_TASKS_WORKER_THREADS`` of the user's own, else the cores shared out."""
    return worker_threads() or threads_per_process(workers)
