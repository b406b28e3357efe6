"""Non-finite validation metrics reach callbacks as Determined hands them over (its
``_convert_metrics_to_numpy``: top-level tensors as numpy arrays, the rest as returned), and
stay floats in fit()'s result and after a resume (read back from the checkpoint's
metadata.json), nested in lists too; never their ``str()`` ('inf', 'nan')."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from tests.fixtures.trials import OneVarTrial

HPARAMS = {"learning_rate": 0.1, "global_batch_size": 4}


class SeenByCallback(pytorch.PyTorchCallback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        self.metrics.append(metrics)


class NonFiniteFullDataset(OneVarTrial):
    """evaluate_full_dataset returning numpy and torch non-finite values, some in a list."""

    evaluate_batch = pytorch.PyTorchTrial.evaluate_batch  # use evaluate_full_dataset only

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        super().__init__(context)
        self.seen = SeenByCallback()

    def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
        return {
            "val_loss": np.float32("inf"),
            "per_class": [np.float32("nan"), torch.tensor(-math.inf), 0.5],
            "worst": torch.tensor([math.nan]),
        }

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"seen": self.seen}


def _check(metrics: dict[str, Any]) -> None:
    assert math.isinf(metrics["val_loss"]) and metrics["val_loss"] > 0
    first, second, third = metrics["per_class"]
    assert isinstance(first, float) and math.isnan(first)
    assert isinstance(second, float) and second == -math.inf
    assert third == 0.5
    assert isinstance(metrics["worst"], float) and math.isnan(metrics["worst"])


def _check_seen_by_callback(metrics: dict[str, Any]) -> None:
    assert type(metrics["val_loss"]) is np.float32
    assert math.isinf(metrics["val_loss"]) and metrics["val_loss"] > 0
    first, second, third = metrics["per_class"]
    assert type(first) is np.float32 and math.isnan(first)
    assert isinstance(second, torch.Tensor) and second.item() == -math.inf
    assert third == 0.5
    worst = metrics["worst"]
    assert isinstance(worst, np.ndarray) and worst.dtype == np.float32 and math.isnan(worst[0])


def test_non_finite_metrics_are_determineds_in_callbacks_floats_in_results_and_after_resume(
    tmp_path,
):
    store = LocalDirectoryStore(tmp_path)
    ctx = pytorch.init(hparams=HPARAMS, checkpoint_store=store)
    trial = NonFiniteFullDataset(ctx)
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(2), checkpoint_policy="all")
    _check_seen_by_callback(trial.seen.metrics[-1])
    _check(result.validation_metrics)

    # The checkpoint was validated at its batch: a resume reads its metrics back.
    ctx = pytorch.init(hparams=HPARAMS, checkpoint_store=store)
    resumed = pytorch.Trainer(NonFiniteFullDataset(ctx), ctx).fit(
        max_length=pytorch.Batch(2),
        latest_checkpoint=result.checkpoint_uuid,
        checkpoint_policy="all",
    )
    _check(resumed.validation_metrics)


def test_reduced_batch_metric_that_is_infinite_is_a_float(tmp_path):
    class InfiniteLoss(OneVarTrial):
        def evaluate_batch(self, batch: Any) -> dict[str, Any]:
            return {"val_loss": torch.tensor(math.inf)}

    ctx = pytorch.init(hparams=HPARAMS, checkpoint_store=LocalDirectoryStore(tmp_path))
    result = pytorch.Trainer(InfiniteLoss(ctx), ctx).fit(
        max_length=pytorch.Batch(2), checkpoint_policy="all"
    )
    assert result.validation_metrics == {"val_loss": math.inf}
