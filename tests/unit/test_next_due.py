"""The loop skips its boundary checks until the next due batch: ``next_due`` must name exactly
the first batch count at which ``is_due`` holds, for every kind of period."""

from __future__ import annotations

import pytest

from det_tasks.pytorch import Batch, Epoch


@pytest.mark.parametrize(
    "unit", [Batch(1), Batch(3), Batch(7), Epoch(1), Epoch(2), Batch([5, 30, 45]), Epoch([1, 3])]
)
@pytest.mark.parametrize("epoch_len", [1, 4, 5])
def test_next_due_is_the_first_due_batch(unit, epoch_len):
    for done in range(60):
        brute = next((d for d in range(done + 1, 400) if unit.is_due(d, epoch_len)), None)
        assert unit.next_due(done, epoch_len) == brute, done
