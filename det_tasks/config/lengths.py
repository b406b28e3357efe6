"""A config length (``{batches|epochs|records: N}``) in the units training counts: the rule
is ``Length.counted`` (one place); this module keeps the function form its callers use."""

from __future__ import annotations

from det_tasks.config.experiment import Length

__all__ = ["in_batches_or_epochs"]


def in_batches_or_epochs(
    length: Length, global_batch_size: int | None, records_per_epoch: int | None = None
) -> Length:
    """``length`` as ``{batches: N}`` or ``{epochs: N}`` (``Length.counted``)."""
    return length.counted(global_batch_size, records_per_epoch)
