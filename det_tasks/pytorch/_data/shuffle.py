"""``DataLoader(shuffle=True)``'s order: Determined's, and still resumable exactly.

Determined builds a plain ``torch.utils.data.RandomSampler``: each pass over the data
draws one int64 from the global torch generator (or permutes with the loader's own
``generator``) when its first batch is fetched, so the order, and every random number
drawn after it (dropout, augmentation), depend on that draw. ``EpochShuffleSampler``
draws exactly the same, and remembers each pass's draw so that a checkpoint can record
it: a run resumed mid-epoch replays that pass's order without drawing again, where
Determined draws a fresh order and skips into it (so its resumed run differs from the
uninterrupted one; ours equals it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data

__all__ = ["EpochShuffleSampler"]

_KEPT = 4  # recent passes remembered: the one being trained and any fetched ahead


class EpochShuffleSampler(torch.utils.data.Sampler):
    """A ``RandomSampler`` whose passes are numbered and whose draws are remembered."""

    def __init__(self, data_source: Sized, generator: torch.Generator | None = None) -> None:
        self._n = len(data_source)
        self.generator = generator
        self._next_pass = 0
        self._drawn: dict[int, Any] = {}  # pass -> seed (int) or generator state (tensor)
        self._replay: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._n

    def start_at(self, first_pass: int, recorded: dict[int, Any] | None) -> None:
        """Resume: the next pass is ``first_pass``; passes in ``recorded`` replay their
        recorded draw instead of drawing (they were drawn before the checkpoint)."""
        self._next_pass = first_pass
        self._replay = dict(recorded or {})

    def recorded(self) -> dict[int, Any]:
        """The draws of the latest passes, for a checkpoint."""
        return dict(self._drawn)

    def __iter__(self) -> Iterator[int]:
        number = self._next_pass
        self._next_pass += 1
        generator = self._generator_for(number)
        yield from torch.randperm(self._n, generator=generator).tolist()
        torch.randperm(self._n, generator=generator)  # RandomSampler's empty remainder call

    def _generator_for(self, number: int) -> torch.Generator:
        replay = self._replay.pop(number, None)
        if self.generator is not None:
            if replay is not None:
                self.generator.set_state(replay)
            self._remember(number, self.generator.get_state())
            return self.generator
        if replay is None:
            replay = int(torch.empty((), dtype=torch.int64).random_().item())
        self._remember(number, int(replay))
        return torch.Generator().manual_seed(int(replay))

    def _remember(self, number: int, draw: Any) -> None:
        self._drawn[number] = draw
        for old in sorted(self._drawn)[:-_KEPT]:
            del self._drawn[old]
