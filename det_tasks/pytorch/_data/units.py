"""Training lengths and periods: ``Batch(100)``, ``Epoch(2)``, ``Batch([5, 30, 45])``."""

from __future__ import annotations

import collections.abc
from typing import Any

__all__ = ["Batch", "Epoch", "TrainUnit"]


class TrainUnit:
    """A count of batches or epochs: an int (every N) or a container of exact points.

    Determined silently treated a value below 1 as "never"; here it is an error.
    """

    def __init__(self, value: int | collections.abc.Container[int]) -> None:
        if isinstance(value, bool) or not isinstance(value, int | collections.abc.Container):
            raise TypeError(
                f"{type(self).__name__}() takes an int or a list of ints, got {value!r}"
            )
        if isinstance(value, int) and value < 1:
            raise ValueError(
                f"{type(self).__name__}({value}) is not a valid length: use a value >= 1 "
                "(to disable a period, pass None instead of a unit)"
            )
        if isinstance(value, collections.abc.Iterable) and not isinstance(value, int):
            points = list(value)
            if any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in points):
                raise ValueError(
                    f"{type(self).__name__}({value!r}): every point must be an int >= 1"
                )
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and self.value == other.value

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self.value)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def to_batches(self, epoch_len: int) -> int:
        """The length in batches; only for int values (max_length)."""
        if not isinstance(self.value, int):
            raise ValueError(f"{self!r} is a list of points, not a length")
        return self.value * (epoch_len if isinstance(self, Epoch) else 1)

    def is_due(self, batches_done: int, epoch_len: int) -> bool:
        """True when a period in this unit ends exactly after ``batches_done`` batches."""
        if isinstance(self, Epoch):
            if batches_done % epoch_len:
                return False
            count = batches_done // epoch_len
        else:
            count = batches_done
        if count == 0:
            return False
        if isinstance(self.value, int):
            return count % self.value == 0
        return count in self.value

    def next_due(self, batches_done: int, epoch_len: int) -> int | None:
        """The first batch count after ``batches_done`` at which ``is_due`` holds (None:
        never again; a container that cannot be listed gives the next batch)."""
        scale = epoch_len if isinstance(self, Epoch) else 1
        if isinstance(self.value, int):
            return (batches_done // scale // self.value + 1) * self.value * scale
        if not isinstance(self.value, collections.abc.Iterable):
            return batches_done + 1
        later = [p * scale for p in self.value if p * scale > batches_done]
        return min(later) if later else None


class Batch(TrainUnit):
    """A number of batches (optimizer steps times aggregation frequency)."""


class Epoch(TrainUnit):
    """A number of passes over the training data loader."""
