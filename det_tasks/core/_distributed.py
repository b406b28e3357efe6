"""``core.DistributedContext``: the harness's rank, size and collectives, as the Core API
names them (``DummyDistributedContext`` is the one-process group)."""

from __future__ import annotations

from det_tasks.distributed import DistributedContext

__all__ = ["DistributedContext", "DummyDistributedContext"]


class DummyDistributedContext(DistributedContext):
    """One process, rank 0 of 1: collectives return their argument (Determined's name)."""

    def __init__(self) -> None:
        super().__init__()
