"""``core.DistributedContext``: the harness's rank, size and collectives under the Core
API's name, with Determined's constructors (``from_torch_distributed``, ``from_horovod``,
``from_deepspeed``); ``DummyDistributedContext`` is the one-process group."""

from __future__ import annotations

from det_tasks.distributed import DistributedContext as _HarnessContext

__all__ = ["DistributedContext", "DummyDistributedContext"]


class DistributedContext(_HarnessContext):
    """Rank, size and collectives of a Core API script's workers."""

    @classmethod
    def from_deepspeed(cls) -> DistributedContext:
        """Join the group DeepSpeed's launcher (or torchrun) describes, through DeepSpeed's
        own set-up; its collectives are torch.distributed's."""
        try:
            import deepspeed
        except ImportError:
            raise ImportError(
                "DistributedContext.from_deepspeed() needs DeepSpeed (pip install deepspeed); "
                "without it use DistributedContext.from_torch_distributed()"
            ) from None
        deepspeed.init_distributed(auto_mpi_discovery=False)
        context = cls.from_torch_distributed()
        assert isinstance(context, DistributedContext)
        return context


class DummyDistributedContext(DistributedContext):
    """One process, rank 0 of 1: collectives return their argument (Determined's name)."""

    def __init__(self) -> None:
        super().__init__()
