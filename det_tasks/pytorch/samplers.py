"""Resumable, shardable samplers (Determined's ``det.pytorch.samplers``).

Wrapping order for training: sampler -> BatchSampler -> DistributedBatchSampler ->
RepeatBatchSampler -> SkipBatchSampler; each is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data

__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleSampler",
    "SkipBatchSampler",
    "SkipSampler",
]


class ReproducibleShuffleSampler(torch.utils.data.Sampler):
    """A shuffle whose order depends only on (seed, epoch), never on the global RNG."""

    def __init__(self, data_source: Sized, seed: int) -> None:
        self._n = len(data_source)
        self._seed = seed
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self._seed * 100_003 + self._epoch)
        self._epoch += 1
        return iter(torch.randperm(self._n, generator=gen).tolist())


class RepeatBatchSampler(torch.utils.data.Sampler):
    """Loops a batch sampler forever, advancing the shuffle epoch each pass."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            empty = True
            for batch in self.batch_sampler:
                empty = False
                yield batch
            if empty:
                raise ValueError("the training data loader yields no batches (empty dataset?)")


RepeatSampler = RepeatBatchSampler


class SkipBatchSampler(torch.utils.data.Sampler):
    """Skips the first ``skip`` batches: how a resumed trial continues where it stopped."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.batch_sampler)
        for _ in range(self.skip):
            next(it)
        yield from it


SkipSampler = SkipBatchSampler


class DistributedBatchSampler(torch.utils.data.Sampler):
    """Rank r takes batches r, r+N, r+2N, ... of the underlying batch sampler.

    Determined's order: the DataLoader's batch size is the per-slot batch size, and one
    global batch is N consecutive per-slot batches, one per rank. Over a non-repeating
    sampler whose length N does not divide, the first ranks get one batch more (validation
    tolerates that; training always wraps a repeating sampler).
    """

    def __init__(self, batch_sampler: Any, num_workers: int, rank: int) -> None:
        if not 0 <= rank < num_workers:
            raise ValueError(f"rank {rank} is out of range for {num_workers} workers")
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.rank = rank

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        return n // self.num_workers + int(n % self.num_workers > self.rank)

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i % self.num_workers == self.rank:
                yield batch


class DistributedSampler(torch.utils.data.Sampler):
    """Record-level sharding of a sampler: rank r takes records r, r+size, ..."""

    def __init__(self, sampler: Any, num_workers: int, rank: int) -> None:
        self.sampler = sampler
        self.num_workers = num_workers
        self.rank = rank

    def __len__(self) -> int:
        return len(range(self.rank, len(self.sampler), self.num_workers))

    def __iter__(self) -> Iterator[int]:
        for i, idx in enumerate(self.sampler):
            if i % self.num_workers == self.rank:
                yield idx
