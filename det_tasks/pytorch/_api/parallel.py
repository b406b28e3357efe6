"""Data-parallel glue: DDP for torch.distributed, DistributedOptimizer for Horovod.

One process gets the model and optimizer back unchanged, so the single-process path has
no wrapper cost.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from det_tasks.distributed import DistributedContext

__all__ = [
    "no_sync",
    "skip_synchronize",
    "synchronize",
    "synchronizes",
    "wrap_model",
    "wrap_optimizer",
]

_NOTHING = contextlib.nullcontext()  # reusable, so the one-process path allocates nothing


def wrap_model(
    model: torch.nn.Module, dist: DistributedContext, device: torch.device
) -> torch.nn.Module:
    if dist.size == 1:
        return model
    if dist.backend == "torch":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if dist.backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model
    raise ValueError(f"unknown distributed backend {dist.backend!r}")


def wrap_optimizer(
    optimizer: torch.optim.Optimizer,
    dist: DistributedContext,
    models: list[torch.nn.Module],
    backward_passes_per_step: int,
    fp16_compression: bool,
) -> torch.optim.Optimizer:
    if dist.size > 1 and dist.backend != "horovod" and fp16_compression:
        warnings.warn(
            "optimizations.gradient_compression / wrap_optimizer(fp16_compression=True) "
            "compresses Horovod's allreduce; under torch.distributed DDP it has no effect "
            "(use resources.distributed_backend: horovod, or register DDP's "
            "fp16_compress_hook on the model yourself)",
            UserWarning,
            stacklevel=3,
        )
    if dist.size == 1 or dist.backend != "horovod":
        return optimizer
    import horovod.torch as hvd

    named = [(n, p) for m in models for n, p in m.named_parameters()]
    compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=named,
        backward_passes_per_step=backward_passes_per_step,
        compression=compression,
    )
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    return wrapped


def synchronizes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` allreduces gradients itself (Horovod's synchronize())."""
    return callable(getattr(optimizer, "synchronize", None)) or callable(
        getattr(optimizer, "skip_synchronize", None)
    )


def synchronize(optimizer: torch.optim.Optimizer) -> None:
    """Finish Horovod's gradient allreduce before clipping reads the gradients."""
    sync = getattr(optimizer, "synchronize", None)
    if callable(sync):
        sync()


def skip_synchronize(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
    skip = getattr(optimizer, "skip_synchronize", None)
    return skip() if callable(skip) else _NOTHING


def no_sync(models: list[torch.nn.Module], active: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip DDP's gradient allreduce on batches that only accumulate (a shared no-op when
    ``active`` is False: the per-batch path of one process pays nothing for it)."""
    return _no_sync(models) if active else _NOTHING


@contextlib.contextmanager
def _no_sync(models: list[torch.nn.Module]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for model in models:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(model.no_sync())
        yield
