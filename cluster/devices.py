"""GPUs of a worker host and how the embedded Dask cluster splits them between workers.

Each worker process owns ``slots`` GPUs for its whole life (``CUDA_VISIBLE_DEVICES`` is set
before CUDA initialises, so it cannot change per task) and advertises them as the Dask
resource ``GPU``; a trial's steps ask for ``GPU=slots_per_trial``, so Dask never runs two
trials on one GPU, and a worker that dies frees its GPUs with it. This replaces the earlier
per-segment lock files and Prefect concurrency limit.
"""

from __future__ import annotations

__all__ = ["gpu_count", "gpu_groups"]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_groups(count: int, slots: int, workers: int | None = None) -> list[list[int]]:
    """GPU indices per worker: disjoint groups of ``slots`` of the host's ``count`` GPUs
    (at most ``workers`` groups); GPUs left over by the division stay unused."""
    if slots < 1:
        raise ValueError(f"resources.slots_per_trial must be >= 1, got {slots}")
    if slots > count:
        raise ValueError(
            f"a trial needs {slots} GPUs (resources.slots_per_trial) but this host has "
            f"{count}; lower slots_per_trial or join workers with more GPUs "
            "(DET_TASKS_DASK_SCHEDULER)"
        )
    groups = [list(range(i, i + slots)) for i in range(0, count - slots + 1, slots)]
    return groups[:workers] if workers else groups


if __name__ == "__main__":  # `python -m cluster.devices`: what this host offers
    print(f"{gpu_count()} GPUs")
