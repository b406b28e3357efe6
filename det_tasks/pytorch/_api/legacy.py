"""Determined's pre-0.13 trial interface (the MNIST tutorial's), run on the current loop.

A legacy trial returns its model from ``build_model()`` and its optimizer from
``optimizer(model)``, and its ``train_batch(batch, model, epoch_idx, batch_idx)`` only
computes the loss. ``LegacyTrialAdapter`` wraps those objects itself and does the
backward pass and the optimizer step, so checkpoints and flows see an ordinary trial.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from det_tasks.errors import TrialError

__all__ = ["LegacyTrialAdapter", "adapt_trial", "is_legacy_trial", "reset_parameters"]

MIGRATION = (
    "Migrate as the API reference describes: (1) wrap models, optimizers and LR schedulers in "
    "__init__ with context.wrap_model / wrap_optimizer / wrap_lr_scheduler and remove "
    "build_model(), optimizer() and create_lr_scheduler(); (2) configure AMP in __init__ "
    "(context.configure_apex_amp or experimental.use_amp) instead of "
    "optimizations.mixed_precision; (3) call context.backward(loss) and "
    "context.step_optimizer(opt) in train_batch(batch, epoch_idx, batch_idx), passing "
    "clip_grads= instead of a gradient-clipping callback."
)


def reset_parameters(model: torch.nn.Module) -> None:
    """Re-initialise every module that knows how, the root included, as
    ``determined.pytorch.reset_parameters`` does."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def is_legacy_trial(trial_class: type) -> bool:
    """True for the 0.12-style interface: build_model() and train_batch(batch, model, ...)."""
    if not callable(getattr(trial_class, "build_model", None)):
        return False
    params = list(inspect.signature(getattr(trial_class, "train_batch")).parameters)  # noqa: B009
    return "model" in params


class LegacyTrialAdapter:
    """Presents a legacy trial as a current PyTorchTrial (same checkpoint format)."""

    def __init__(self, trial: Any, context: Any) -> None:
        self.trial = trial
        self.context = context
        self._det_tasks_user_class = type(trial)
        model = trial.build_model()
        if not isinstance(model, torch.nn.Module):
            raise TrialError(
                f"{type(trial).__name__}.build_model() must return a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
        self.model = context.wrap_model(model)
        if not callable(getattr(trial, "optimizer", None)):
            raise TrialError(
                f"{type(trial).__name__} defines build_model() but no optimizer(model)"
            )
        self.optimizer = context.wrap_optimizer(trial.optimizer(self.model))
        create = getattr(trial, "create_lr_scheduler", None)
        if callable(create):
            scheduler = create(self.optimizer)
            if scheduler is not None:
                from det_tasks.pytorch._api.lr_scheduler import LRScheduler

                if not isinstance(scheduler, LRScheduler):
                    raise TrialError(
                        "create_lr_scheduler() must return det.pytorch.LRScheduler("
                        "torch_scheduler, step_mode), got " + type(scheduler).__name__
                    )
                context.wrap_lr_scheduler(
                    scheduler._scheduler, scheduler._step_mode, scheduler._frequency
                )

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        metrics = self.trial.train_batch(batch, self.model, epoch_idx, batch_idx)
        if isinstance(metrics, torch.Tensor):
            metrics = {"loss": metrics}
        if not isinstance(metrics, dict) or "loss" not in metrics:
            raise TrialError(
                "a legacy train_batch(batch, model, epoch_idx, batch_idx) must return a dict "
                f"with at least 'loss' (the harness runs backward on it); got {metrics!r:.80}"
            )
        self.context.backward(metrics["loss"])
        self.context.step_optimizer(self.optimizer)
        return metrics

    def build_training_data_loader(self) -> Any:
        return self.trial.build_training_data_loader()

    def build_validation_data_loader(self) -> Any:
        return self.trial.build_validation_data_loader()

    def build_callbacks(self) -> Any:
        build = getattr(self.trial, "build_callbacks", None)
        return build() if callable(build) else {}

    def evaluation_reducer(self) -> Any:
        return self.trial.evaluation_reducer()

    def get_batch_length(self, batch: Any) -> int:
        return int(self.trial.get_batch_length(batch))

    def evaluate_batch(self, batch: Any) -> Any:
        return self.trial.evaluate_batch(batch, self.model)

    def evaluate_full_dataset(self, data_loader: Any) -> Any:
        return self.trial.evaluate_full_dataset(data_loader, self.model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trial, name)


def adapt_trial(trial: Any, context: Any) -> Any:
    """The trial itself, or an adapter when it is written in the legacy interface."""
    if isinstance(trial, LegacyTrialAdapter) or not is_legacy_trial(type(trial)):
        return trial
    warnings.warn(
        f"{type(trial).__name__} uses the PyTorchTrial interface of Determined <= 0.12.12 "
        f"(build_model/optimizer/train_batch(batch, model, ...)), which is deprecated. "
        f"{MIGRATION}",
        DeprecationWarning,
        stacklevel=3,
    )
    return LegacyTrialAdapter(trial, context)
