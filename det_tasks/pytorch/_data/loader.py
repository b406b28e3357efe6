"""Batches and devices: ``TorchData``, ``to_device``, ``data_length`` and ``DataLoader``.

``DataLoader`` records torch DataLoader arguments; the harness builds the real loader with
a batch sampler that it controls, so resuming skips batches instead of replaying them and
every rank reads its own shard.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from det_tasks.pytorch import samplers
from det_tasks.pytorch._data.length import iterable_dataset_refusal
from det_tasks.pytorch._data.shuffle import EpochShuffleSampler

__all__ = ["DataLoader", "TorchData", "adapt_batch_sampler", "data_length", "to_device"]

TorchData = dict[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor


def to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor (numpy arrays become tensors) inside nested containers to ``device``."""
    if type(data) in _PLAIN_SEQUENCES:  # the usual batch, [inputs, labels]: checked first
        for v in data:  # a loop, not all(<generator>): this runs once per training batch
            if type(v) is not torch.Tensor or v.device != device:
                break
        else:
            return data  # every tensor already there (CPU training): nothing to rebuild
    if isinstance(data, torch.Tensor):
        if data.device == device:  # already there (CPU training): skip .to()'s arg parsing
            return data
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(device, non_blocking=non_blocking)
    if isinstance(data, dict):
        return type(data)({k: to_device(v, device, non_blocking) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(to_device(v, device, non_blocking) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(to_device(v, device, non_blocking) for v in data)
    return data


_PLAIN_SEQUENCES = (list, tuple)


def data_length(data: Any) -> int:
    """The batch size of a batch: the length of its first tensor or array."""
    if isinstance(data, torch.Tensor | np.ndarray):
        return int(data.shape[0]) if data.ndim else 1
    if isinstance(data, dict):
        return data_length(next(iter(data.values()))) if data else 0
    if isinstance(data, list | tuple):
        return data_length(data[0]) if data else 0
    if isinstance(data, collections.abc.Sized):
        return len(data)
    raise TypeError(
        f"cannot tell the batch length of a {type(data).__name__}; override "
        "PyTorchTrial.get_batch_length(batch) to return it"
    )


def adapt_batch_sampler(
    batch_sampler: Any, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
) -> Any:
    """Determined's helper for custom loaders: repeat, shard, then skip ``skip`` batches of
    this rank's stream (the order Determined applies them in)."""
    if repeat:
        batch_sampler = samplers.RepeatBatchSampler(batch_sampler)
    if num_replicas > 1:
        batch_sampler = samplers.DistributedBatchSampler(batch_sampler, num_replicas, rank)
    if skip > 0:
        batch_sampler = samplers.SkipBatchSampler(batch_sampler, skip)
    return batch_sampler


class DataLoader:
    """Drop-in for ``torch.utils.data.DataLoader`` over map-style datasets.

    The harness wraps the sampling in a resumable, shardable batch sampler. ``shuffle``
    draws each epoch's order as Determined's (torch's RandomSampler: from the global torch
    generator, or ``generator``), so the same seeds give Determined's batches.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: torch.utils.data.Sampler | None = None,
        batch_sampler: torch.utils.data.BatchSampler | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(iterable_dataset_refusal(dataset))
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler or drop_last):
            raise ValueError(
                "batch_sampler is mutually exclusive with batch_size, shuffle, sampler and "
                "drop_last (as in torch.utils.data.DataLoader)"
            )
        if sampler is not None and shuffle:
            raise ValueError("sampler is mutually exclusive with shuffle")
        if batch_sampler is None and (batch_size is None or batch_size < 1):
            raise ValueError(f"DataLoader batch_size must be >= 1, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self._training_shuffle: EpochShuffleSampler | None = None

    def __len__(self) -> int:
        """Batches per epoch on one process."""
        return len(self.make_batch_sampler(seed=0, rank=0, size=1))  # type: ignore[arg-type]

    def make_batch_sampler(
        self,
        seed: int,
        rank: int,
        size: int,
        repeat: bool = False,
        skip: int = 0,
        shuffle_draws: dict[int, Any] | None = None,
    ) -> torch.utils.data.Sampler:
        """The batch sampler the harness iterates: sharded, repeating, skipping.

        ``skip`` counts batches already trained. With a sampler that knows epochs (our
        shuffle, or any with ``set_epoch``) whole epochs are jumped over, not replayed;
        ``shuffle_draws`` (from a checkpoint) replays the shuffle of the epoch resumed in.
        ``seed`` is unused here (the shuffle follows Determined's RNG draws).
        """
        sampler: Any = None
        if self.batch_sampler is not None:
            batch_sampler: Any = self.batch_sampler
        else:
            if self.sampler is not None:
                sampler = self.sampler
            elif self.shuffle:
                sampler = EpochShuffleSampler(self.dataset, self.generator)  # type: ignore[arg-type]
                if repeat:
                    self._training_shuffle = sampler
            else:
                sampler = torch.utils.data.SequentialSampler(self.dataset)  # type: ignore[arg-type]
            assert self.batch_size is not None
            batch_sampler = torch.utils.data.BatchSampler(
                sampler, self.batch_size, drop_last=self.drop_last
            )
        # Determined's order: repeat, skip, then deal batches round-robin to the ranks. A
        # trained batch on each of N ranks is N per-slot batches of the underlying stream.
        epoch_len = len(batch_sampler)
        skip *= size
        if skip and epoch_len and isinstance(sampler, EpochShuffleSampler):
            sampler.start_at(skip // epoch_len, shuffle_draws)
            skip %= epoch_len
        elif skip and epoch_len and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(skip // epoch_len)
            skip %= epoch_len
        if repeat:
            batch_sampler = samplers.RepeatBatchSampler(batch_sampler)
        if skip:
            batch_sampler = samplers.SkipBatchSampler(batch_sampler, skip)
        if size > 1:
            batch_sampler = samplers.DistributedBatchSampler(batch_sampler, size, rank)
        return batch_sampler

    def get_data_loader(
        self,
        seed: int = 0,
        rank: int = 0,
        size: int = 1,
        repeat: bool = False,
        skip: int = 0,
        *,
        private_generator: bool = True,
        shuffle_draws: dict[int, Any] | None = None,
    ) -> torch.utils.data.DataLoader:
        """A torch DataLoader over this loader's batches (what the harness iterates).

        Its iterators draw their workers' base seed from a generator seeded by ``seed``
        (so resuming is exact), or, with ``private_generator=False``, from this loader's
        ``generator`` or the global one, as Determined's do (evaluate_full_dataset).
        """
        generator = self.generator
        if generator is None and private_generator:
            generator = torch.Generator().manual_seed(seed)
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=self.make_batch_sampler(seed, rank, size, repeat, skip, shuffle_draws),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn,
            multiprocessing_context=self.multiprocessing_context,
            generator=generator,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )

    def shuffle_draws(self) -> dict[int, Any]:
        """The training shuffle's recent draws (epoch -> seed), for a checkpoint."""
        return self._training_shuffle.recorded() if self._training_shuffle else {}

    def draws_from_global_rng(self) -> bool:
        """Whether iterating draws from the global torch generator (the shuffle without a
        ``generator``): then only the training thread may iterate it, in step order."""
        return (
            self.shuffle
            and self.generator is None
            and self.sampler is None
            and self.batch_sampler is None
        )

    def supports_fast_gather(self) -> bool:
        """True when a whole batch can be gathered with one index op per tensor.

        That holds for a ``TensorDataset`` with the default collate: ``t[indices]`` equals
        stacking ``t[i]`` for each i, bit for bit, without per-sample Python work.
        """
        return (
            isinstance(self.dataset, torch.utils.data.TensorDataset)
            and self.collate_fn is None
            and self.num_workers == 0
        )
