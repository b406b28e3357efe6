"""How many CPU threads a training process gets when several share a host (imports nothing
heavy: the stack's scripts use it to start Dask workers)."""

from __future__ import annotations

import os

__all__ = ["WORKER_THREADS_ENV", "threads_per_process"]

# The CPU threads a warm Dask worker's trials train on, set per worker by whoever starts it
# (flows.engine's embedded cluster, infra.dask_cluster); unset: Dask's one thread.
WORKER_THREADS_ENV = "DET_TASKS_WORKER_THREADS"


def threads_per_process(processes: int) -> int:
    """CPU threads each of ``processes`` training processes on this host gets (at least 1):
    the cores shared out, as a Determined container would have them all for one trial."""
    return max((os.cpu_count() or 1) // max(processes, 1), 1)
