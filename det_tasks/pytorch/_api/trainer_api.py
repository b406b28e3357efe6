"""The "Trainer API for PyTorchTrial" proposal's calls, as thin adapters on the real API.

``context.train`` (and ``fit``) ends in ``Trainer.fit``, ``context.load_checkpoint_trial``
in ``load_trial_from_checkpoint_path``; ``context.build_trial``, ``context.training.hparams``
and ``context.config_data`` read the context. ``context.predict`` is a loop of its own: the
trial's models (or its ``predict_batch``) over a data loader, in eval mode, without grad.

The mixin reaches the context it is mixed into through ``TrialContextView``, the few
members it reads, so this module does not import the context's module (which imports it).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch

from det_tasks.errors import TrialError
from det_tasks.pytorch._data.units import Batch, TrainUnit

__all__ = ["TrainerAPIMixin", "TrialContextView"]

# A registry-provided function mapping a trial id to a checkpoint reference.
TrialCheckpointResolver = Callable[[Any], str]


def _registry_trial_resolver() -> TrialCheckpointResolver | None:
    """The platform's trial-id lookup (``registry``), when it is installed."""
    from det_tasks import plugins

    found = plugins.load_one("det_tasks.trial_resolvers", "mlflow")
    return found if found is not None and os.environ.get("MLFLOW_TRACKING_URI") else None


class TrialContextView(Protocol):
    """What the mixin uses of the context it is mixed into (PyTorchTrialContext)."""

    device: torch.device
    models: list[torch.nn.Module]

    @property
    def hparams(self) -> dict[str, Any]: ...

    def get_data_config(self) -> dict[str, Any]: ...

    def to_device(self, data: Any) -> Any: ...


class TrainerAPIMixin:
    """Mixed into PyTorchTrialContext."""

    _trial_checkpoint_resolver: TrialCheckpointResolver | None = None
    _trainer: Callable[[Any, Any], Any] | None = None  # set by PyTorchTrialContext
    _checkpoint_loader: Callable[..., Any] | None = None
    device: torch.device  # set by PyTorchTrialContext.__init__

    @staticmethod
    def _require(call: str, service: Callable[..., Any] | None) -> Callable[..., Any]:
        if service is None:
            raise TrialError(
                f"context.{call}() needs a context made by det.pytorch.init(); this one "
                "(rebuilt from a checkpoint for inference) has no Trainer behind it"
            )
        return service

    @property
    def training(self: TrialContextView) -> types.SimpleNamespace:
        """``context.training.hparams`` (the proposal's trainer-context view)."""
        return types.SimpleNamespace(hparams=self.hparams)

    @property
    def config_data(self: TrialContextView) -> dict[str, Any]:
        """The config's free-form ``data:`` section."""
        return self.get_data_config()

    def build_trial(self, trial_class: type, *args: Any, **kwargs: Any) -> Any:
        """``trial_class(context, ...)``."""
        from det_tasks.pytorch._api.legacy import adapt_trial

        return adapt_trial(trial_class(self, *args, **kwargs), self)

    def train(
        self,
        trial: Any,
        train_data: Any = None,
        val_data: Any = None,
        *,
        min_validation_period: TrainUnit | None = None,
        min_checkpoint_period: TrainUnit | None = None,
        max_length: TrainUnit | None = None,
        reporting_period: TrainUnit | None = None,
        checkpoint_policy: str = "best",
        latest_checkpoint: str | None = None,
        test_mode: bool = False,
    ) -> dict[str, Any] | None:
        """Train ``trial`` (optionally on these loaders); returns the last validation metrics."""
        trainer = self._require("train", self._trainer)
        if train_data is not None:
            trial.build_training_data_loader = lambda: train_data
        if val_data is not None:
            trial.build_validation_data_loader = lambda: val_data
        result = trainer(trial, self).fit(
            checkpoint_period=min_checkpoint_period,
            validation_period=min_validation_period,
            max_length=max_length,
            reporting_period=reporting_period or Batch(100),
            checkpoint_policy=checkpoint_policy,
            latest_checkpoint=latest_checkpoint,
            test_mode=test_mode,
        )
        return result.validation_metrics

    fit = train

    def load_checkpoint_trial(
        self,
        trial_class: type,
        trial_id: Any = None,
        *,
        path: str | None = None,
        trial_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """A trial restored from a checkpoint path/URI, or from a trial id via the registry."""
        load_trial_from_checkpoint_path = self._require(
            "load_checkpoint_trial", self._checkpoint_loader
        )
        if (trial_id is None) == (path is None):
            raise ValueError("load_checkpoint_trial needs exactly one of trial_id= or path=")
        if path is None:
            resolver = self._trial_checkpoint_resolver or _registry_trial_resolver()
            if resolver is None:
                raise TrialError(
                    f"load_checkpoint_trial(trial_id={trial_id!r}) needs the registry to find "
                    "that trial's checkpoint: run under the platform (MLflow configured), or "
                    "pass path= with a checkpoint directory or URI"
                )
            path = resolver(trial_id)
        return load_trial_from_checkpoint_path(
            path,
            trial_class=trial_class,
            trial_kwargs=trial_kwargs,
            torch_load_kwargs={"map_location": str(self.device)},
        )

    def predict(self: TrialContextView, trial: Any, data_loader: Any) -> torch.Tensor:
        """Every batch's outputs, concatenated along dim 0.

        Uses ``trial.predict_batch(batch)`` when the trial defines it; otherwise the
        trial's single model applied to the batch's inputs (its first element).
        """
        ctx: TrialContextView = trial.context if hasattr(trial, "context") else self
        loader = (
            data_loader.get_data_loader()
            if hasattr(data_loader, "get_data_loader")
            else data_loader
        )
        predict_batch = getattr(trial, "predict_batch", None)
        if predict_batch is None and len(ctx.models) != 1:
            raise TrialError(
                f"predict() needs trial.predict_batch(batch) when the trial has "
                f"{len(ctx.models)} models"
            )
        for model in ctx.models:
            model.eval()
        outputs = []
        with torch.no_grad():
            for batch in loader:
                batch = ctx.to_device(batch)
                if predict_batch is not None:
                    out = predict_batch(batch)
                else:
                    inputs = batch[0] if isinstance(batch, list | tuple) else batch
                    out = ctx.models[0](inputs)
                outputs.append(out.detach().cpu() if isinstance(out, torch.Tensor) else out)
        if not outputs:
            raise TrialError("predict(): the data loader yielded no batches")
        if all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs)
        raise TrialError("predict(): predict_batch must return tensors to be concatenated")
