"""A config length (``{batches|epochs|records: N}``) in the units training counts.

One rule, used by the local runner, a held trial and ``Trainer.fit`` alike: batches stay
batches; records are ``N // global_batch_size`` batches; epochs become
``N * records_per_epoch // global_batch_size`` batches when the config gives
``records_per_epoch`` (Determined's rule: the trial's epoch is what the config says, not what
its data loader happens to yield), else stay epochs of the training data loader. A length
never rounds down to zero batches: it is at least one.
"""

from __future__ import annotations

from det_tasks.config.experiment import Length
from det_tasks.errors import ConfigError

__all__ = ["in_batches_or_epochs"]


def in_batches_or_epochs(
    length: Length, global_batch_size: int | None, records_per_epoch: int | None = None
) -> Length:
    """``length`` as ``{batches: N}`` or ``{epochs: N}`` (see the module's rule)."""
    gbs = global_batch_size if isinstance(global_batch_size, int) and global_batch_size else None
    if length.unit == "batches":
        return length
    if length.unit == "epochs":
        if records_per_epoch and gbs:
            return Length(batches=max(length.value * records_per_epoch // gbs, 1))
        return length
    if gbs is None:
        raise ConfigError(
            f"length {{records: {length.value}}} needs "
            "hyperparameters.global_batch_size (a positive int) to count batches: add it, or "
            "give the length in batches"
        )
    return Length(batches=max(length.value // gbs, 1))
