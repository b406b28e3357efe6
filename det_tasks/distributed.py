"""Which worker this process is, and the object collectives ranks use to agree.

A single process needs no backend. Under ``torchrun`` the collectives run over
torch.distributed (Gloo on CPU, NCCL on GPU); under ``horovodrun`` over Horovod.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

__all__ = ["DistributedContext"]


class _Collectives(Protocol):
    def allgather(self, obj: Any) -> list[Any]: ...
    def broadcast(self, obj: Any) -> Any: ...
    def close(self, wait_for_others: bool = True) -> None: ...


class _TorchCollectives:
    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._dist.get_world_size()
        self._dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, wait_for_others: bool = True) -> None:
        if self._dist.is_initialized():
            if wait_for_others:  # nobody tears the group down under a rank still using it
                self._dist.barrier()
            self._dist.destroy_process_group()


class _HorovodCollectives:
    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd

    def allgather(self, obj: Any) -> list[Any]:
        # Explicit names: Horovod's default is the object's type name, so a chief sending a
        # str while the others send None would wait on different operations forever.
        return list(self._hvd.allgather_object(obj, name="det_tasks.allgather"))

    def broadcast(self, obj: Any) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=0, name="det_tasks.broadcast")

    def close(self, wait_for_others: bool = True) -> None:
        if wait_for_others:
            self._hvd.join()
        self._hvd.shutdown()


class DistributedContext:
    """Rank, size and collectives (``context.distributed`` in trial code)."""

    def __init__(
        self,
        *,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        local_size: int = 1,
        cross_rank: int = 0,
        cross_size: int = 1,
        collectives: _Collectives | None = None,
        backend: str = "single",
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is out of range for size {size}")
        if size > 1 and collectives is None:
            raise ValueError("a DistributedContext with size > 1 needs a collectives backend")
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.cross_rank = cross_rank
        self.cross_size = cross_size
        self.backend = backend
        self._collectives = collectives

    @classmethod
    def from_torch_distributed(cls) -> DistributedContext:
        """Join (or reuse) the torch.distributed group torchrun describes in the environment."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
        size = dist.get_world_size()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        return cls(
            rank=dist.get_rank(),
            size=size,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_size=local_size,
            cross_rank=int(os.environ.get("GROUP_RANK", 0)),
            cross_size=max(size // max(local_size, 1), 1),
            collectives=_TorchCollectives(),
            backend="torch",
        )

    @classmethod
    def from_horovod(cls, hvd: Any) -> DistributedContext:
        """Use an initialised ``horovod.torch`` module for rank, size and collectives."""
        return cls(
            rank=hvd.rank(),
            size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
            cross_rank=hvd.cross_rank(),
            cross_size=hvd.cross_size(),
            collectives=_HorovodCollectives(hvd),
            backend="horovod",
        )

    def get_rank(self) -> int:
        return self.rank

    def get_size(self) -> int:
        return self.size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_size(self) -> int:
        return self.local_size

    def get_cross_rank(self) -> int:
        return self.cross_rank

    def get_cross_size(self) -> int:
        return self.cross_size

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def allgather(self, stuff: Any) -> list[Any]:
        """Every rank's ``stuff``, in rank order, on every rank."""
        if self._collectives is None:
            return [stuff]
        return self._collectives.allgather(stuff)

    def gather(self, stuff: Any) -> list[Any] | None:
        """Every rank's ``stuff`` on the chief; None elsewhere."""
        gathered = self.allgather(stuff)
        return gathered if self.rank == 0 else None

    def broadcast(self, stuff: Any) -> Any:
        """The chief's ``stuff`` on every rank."""
        if self._collectives is None:
            return stuff
        return self._collectives.broadcast(stuff)

    def allgather_local(self, stuff: Any) -> list[Any]:
        """``stuff`` from every rank on this node."""
        everyone = self.allgather((self.cross_rank, stuff))
        return [s for node, s in everyone if node == self.cross_rank]

    def gather_local(self, stuff: Any) -> list[Any] | None:
        local = self.allgather_local(stuff)
        return local if self.local_rank == 0 else None

    def broadcast_local(self, stuff: Any) -> Any:
        """The local chief's ``stuff`` on every rank of this node."""
        everyone = self.allgather((self.cross_rank, self.local_rank, stuff))
        return next(s for node, lr, s in everyone if node == self.cross_rank and lr == 0)

    def shard_batch_size(self, global_batch_size: int) -> int:
        """This rank's share of a global batch (the Trainer-API proposal's helper)."""
        if global_batch_size < self.size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is smaller than the {self.size} "
                "workers; raise it to at least the number of slots"
            )
        return global_batch_size // self.size

    def close(self, wait_for_others: bool = True) -> None:
        """Leave the worker group (once); with ``wait_for_others``, after every rank is done."""
        if self._collectives is not None:
            collectives, self._collectives = self._collectives, None
            collectives.close(wait_for_others)
