"""Resumable, shardable samplers (Determined's ``det.pytorch.samplers``).

Building blocks for custom loaders, as Determined's: sampler -> BatchSampler ->
RepeatBatchSampler -> DistributedBatchSampler -> SkipBatchSampler (``adapt_batch_sampler``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleBatchSampler",
    "ReproducibleShuffleSampler",
    "SkipBatchSampler",
    "SkipSampler",
]

_END = object()


class ReproducibleShuffleSampler(torch.utils.data.Sampler):
    """Determined's: each pass shuffles the wrapped sampler's indices with one numpy
    ``RandomState(seed)`` kept across passes, so the order depends only on the seed and the
    pass (a resume that skips through the index stream replays it exactly)."""

    def __init__(self, sampler: Any, seed: int) -> None:
        self._sampler = sampler
        self._rng = np.random.RandomState(seed)

    def __len__(self) -> int:
        return len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        indices = list(self._sampler)
        self._rng.shuffle(indices)
        return iter(indices)


class ReproducibleShuffleBatchSampler(ReproducibleShuffleSampler):
    """The same over a batch sampler: whole batches change places, their contents do not."""


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
        """The wrapped sampler's length, as Determined's: the loop's epoch length must not
        shrink on a resume (the skip applies once, to a repeating stream)."""
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.batch_sampler)
        for _ in range(self.skip):
            if next(it, _END) is _END:
                return
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
