"""How long an epoch of the training loader is, and what a loader without a length allows.

Determined takes ``len()`` of the training loader as the epoch. A loader without one (a
plain ``torch.utils.data.DataLoader`` over an ``IterableDataset`` without ``__len__``: a
stream) has epochs that never end there (``sys.maxsize`` batches), so it trains for a
length in batches, or in records (``global_batch_size`` turns them into batches), and a
length in epochs needs ``records_per_epoch``, which turns epochs into batches before the
loop sees them. A length still in epochs with such a loader would train forever: it is
refused when the trial starts, with one line naming ``records_per_epoch``. The config
alone cannot tell (a sized loader counts epochs itself), so ``check-config`` accepts it.

The messages here and ``det_tasks.pytorch.DataLoader``'s refusal of an iterable dataset
name the same way that works, so a user following either reaches a running trial.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.utils.data

from det_tasks.errors import TrialError
from det_tasks.pytorch._data.units import Epoch, TrainUnit

__all__ = [
    "ITERABLE_DATASET_FIX",
    "UNSIZED_EPOCH",
    "epoch_length",
    "iterable_dataset_refusal",
    "plain_loader_refusal",
]

# An epoch that never ends: Determined's value for a loader without len().
UNSIZED_EPOCH = sys.maxsize

ITERABLE_DATASET_FIX = (
    "return a plain torch.utils.data.DataLoader from build_training_data_loader() and call "
    "context.experimental.disable_dataset_reproducibility_checks() in __init__ (the stream "
    "then owns its sharding and resume position, as in Determined)"
)


def iterable_dataset_refusal(dataset: Any) -> str:
    """``det_tasks.pytorch.DataLoader``'s one line for an IterableDataset."""
    return (
        f"det_tasks.pytorch.DataLoader needs a map-style dataset (with __getitem__ and "
        f"__len__) so training can resume mid-epoch, and {type(dataset).__name__} is an "
        f"IterableDataset: {ITERABLE_DATASET_FIX}"
    )


def plain_loader_refusal(loader: torch.utils.data.DataLoader) -> str:
    """The one line for a plain torch DataLoader while reproducibility checks are on."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return (
            "build_training_data_loader() returned a torch.utils.data.DataLoader over "
            f"{type(loader.dataset).__name__}, an IterableDataset: keep it and call "
            "context.experimental.disable_dataset_reproducibility_checks() in __init__ "
            "(det_tasks.pytorch.DataLoader takes map-style datasets only)"
        )
    return (
        "build_training_data_loader() returned a torch.utils.data.DataLoader; return "
        "det_tasks.pytorch.DataLoader (same arguments) so training resumes exactly, or "
        "call context.experimental.disable_dataset_reproducibility_checks() in __init__"
    )


def epoch_length(loader: Any, workers: int, lengths: dict[str, TrainUnit | None]) -> int:
    """Global batches per epoch (each takes one per-slot batch from every worker), or
    UNSIZED_EPOCH for a loader without a length; ``lengths`` (the config's names for the
    trial's length and periods) may then hold no epochs."""
    try:
        per_slot = len(loader)
    except TypeError:  # torch's DataLoader over an IterableDataset without __len__
        _refuse_epochs_of_unsized(loader, lengths)
        return UNSIZED_EPOCH
    epoch_len = per_slot // workers
    if epoch_len == 0 and per_slot > 0:
        raise TrialError(
            f"the training loader has {per_slot} per-slot batches per epoch, "
            f"fewer than the {workers} workers: use more data or fewer slots"
        )
    if epoch_len == 0:
        raise TrialError("build_training_data_loader() returned a loader with no batches")
    return epoch_len


def _refuse_epochs_of_unsized(loader: Any, lengths: dict[str, TrainUnit | None]) -> None:
    in_epochs = [f"{name} = {unit!r}" for name, unit in lengths.items() if isinstance(unit, Epoch)]
    if not in_epochs:
        return
    dataset = getattr(loader, "dataset", loader)
    raise TrialError(
        f"{' and '.join(in_epochs)} is in epochs, but the training loader has no length "
        f"({type(dataset).__name__} has no __len__), so an epoch never ends: set "
        "records_per_epoch in the config (the records in one pass), or give the length in "
        "batches, e.g. max_length: {batches: 1000}"
    )
