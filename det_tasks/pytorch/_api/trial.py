"""``PyTorchTrial``: the class users subclass (Determined's contract, 0.38)."""

from __future__ import annotations

import abc
import inspect
from typing import Any

import torch

from det_tasks.errors import TrialError
from det_tasks.pytorch._api.callback import PyTorchCallback
from det_tasks.pytorch._api.context import PyTorchTrialContext
from det_tasks.pytorch._api.reducer import Reducer
from det_tasks.pytorch._data.loader import DataLoader, TorchData, data_length

__all__ = ["PyTorchTrial", "evaluate_batch_defined", "evaluate_full_dataset_defined"]


class PyTorchTrial(abc.ABC):
    """Define models/optimizers in __init__, one training step in train_batch."""

    trial_context_class = PyTorchTrialContext

    @abc.abstractmethod
    def __init__(self, context: PyTorchTrialContext) -> None:
        """Build and wrap models, optimizers and LR schedulers with ``context``."""

    @abc.abstractmethod
    def train_batch(
        self, batch: TorchData, epoch_idx: int, batch_idx: int
    ) -> torch.Tensor | dict[str, Any]:
        """Forward, context.backward, context.step_optimizer; return metrics."""

    def build_training_data_loader(self) -> DataLoader:
        """The training data, as a det_tasks.pytorch.DataLoader.

        Not abstract: the Trainer-API form passes loaders to ``context.train`` instead.
        """
        raise TrialError(
            f"{type(self).__name__} defines no build_training_data_loader(): define it, or "
            "pass the training DataLoader to context.train(trial, train_data, val_data)"
        )

    def build_validation_data_loader(self) -> DataLoader:
        """The validation data, as a det_tasks.pytorch.DataLoader."""
        raise TrialError(
            f"{type(self).__name__} defines no build_validation_data_loader(): define it, or "
            "pass the validation DataLoader to context.train(trial, train_data, val_data)"
        )

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        """Named callbacks; the name keys their state in checkpoints."""
        return {}

    def evaluate_batch(self, batch: TorchData, batch_idx: int) -> dict[str, Any]:
        """Validation metrics of one batch (reduced by evaluation_reducer)."""
        raise NotImplementedError("override evaluate_batch() or evaluate_full_dataset()")

    def evaluation_reducer(self) -> Reducer | dict[str, Reducer]:
        """How per-batch validation metrics combine; AVG by default."""
        return Reducer.AVG

    def evaluate_full_dataset(self, data_loader: torch.utils.data.DataLoader) -> dict[str, Any]:
        """Validation metrics over the whole loader, computed on the chief only."""
        raise NotImplementedError("override evaluate_batch() or evaluate_full_dataset()")

    def get_batch_length(self, batch: Any) -> int:
        """Records in a batch (for throughput and records-based lengths)."""
        return data_length(batch)


def _overrides(trial: Any, name: str) -> bool:
    cls = getattr(trial, "_det_tasks_user_class", type(trial))  # legacy adapters
    impl = getattr(cls, name, None)
    return impl is not None and impl is not getattr(PyTorchTrial, name)


def evaluate_batch_defined(trial: Any) -> bool:
    return _overrides(trial, "evaluate_batch")


def evaluate_full_dataset_defined(trial: Any) -> bool:
    return _overrides(trial, "evaluate_full_dataset")


def evaluate_batch_takes_index(trial: Any) -> bool:
    """Older trials define evaluate_batch(batch); newer ones evaluate_batch(batch, batch_idx)."""
    params = list(inspect.signature(trial.evaluate_batch).parameters)
    return "batch_idx" in params or (len(params) >= 2 and params[1] != "model")
