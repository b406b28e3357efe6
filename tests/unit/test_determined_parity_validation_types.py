"""Issue 41 part 6: validation metrics reach callbacks as Determined 0.38 hands them.

Determined converts each batch's tensors with ``tensor.cpu().numpy()``, stacks them and
reduces with numpy (``np.average``/``sum``/``max``/``min``), so a float32 metric averages in
float32 and reaches ``on_validation_end`` as ``np.float32``, NaN included; a Python float
metric as ``np.float64``; an int tensor summed as ``np.int64``. ``evaluate_full_dataset``'s
tensors arrive as numpy arrays, other values as returned. Across slots, each slot's result
is combined (AVG weighted by its batch count). What the run reports (results, sinks,
checkpoint metadata) stays the same numbers as Python values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch._api.reducer import reduce_batch_metrics
from tests.fixtures.trials import OneVarTrial

HPARAMS = {"learning_rate": 0.1, "global_batch_size": 4}  # 16 validation records: 4 batches
LR = 3e-8  # an LR a decayed schedule reaches; 2.99999992e-08 once it is a float32


class Seen(pytorch.PyTorchCallback):
    def __init__(self, trial: Any) -> None:
        self.trial = trial
        self.end: dict[str, Any] = {}
        self.epoch_end: list[dict[str, Any]] = []

    def on_validation_epoch_end(self, outputs: list[dict[str, Any]]) -> None:
        self.epoch_end = outputs

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        self.end = dict(metrics)
        self.trial.plateau.step(metrics["val_loss"])  # as the lr-scheduler corpus trial does


class LrAndNanTrial(OneVarTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        super().__init__(context)
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, patience=0)
        self.seen = Seen(self)

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"seen": self.seen}

    def evaluation_reducer(self) -> dict[str, pytorch.Reducer]:
        R = pytorch.Reducer
        return {"lr": R.AVG, "val_loss": R.AVG, "count": R.SUM, "plain": R.MAX}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        return {
            "lr": torch.tensor(LR),
            "val_loss": torch.tensor(math.nan),
            "count": torch.tensor(1),
            "plain": 0.25,
        }


def _fit(trial_class: type, tmp_path: Any) -> tuple[Any, Any]:
    ctx = pytorch.init(hparams=HPARAMS, checkpoint_store=LocalDirectoryStore(tmp_path))
    trial = trial_class(ctx)
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(2), checkpoint_policy="all")
    return trial, result


def test_reduced_metrics_reach_callbacks_as_numpy_scalars(tmp_path):
    trial, result = _fit(LrAndNanTrial, tmp_path)
    end = trial.seen.end
    assert type(end["lr"]) is np.float32 and end["lr"] == np.float32(LR)
    assert str(end["lr"]) == "3e-08"  # what a callback writing it to a CSV prints
    assert type(end["val_loss"]) is np.float32 and math.isnan(end["val_loss"])
    assert type(end["count"]) is np.int64 and end["count"] == 4
    assert type(end["plain"]) is np.float64 and end["plain"] == 0.25
    # the same numbers, as Python values, everywhere the run reports them
    reported = result.validation_metrics
    assert reported["lr"] == float(np.float32(LR)) and type(reported["lr"]) is float
    assert type(reported["val_loss"]) is float and math.isnan(reported["val_loss"])
    assert reported["count"] == 4 and reported["plain"] == 0.25


def test_per_batch_outputs_are_numpy_arrays_of_the_tensor_dtype(tmp_path):
    trial, _ = _fit(LrAndNanTrial, tmp_path)
    outputs = trial.seen.epoch_end
    assert len(outputs) == 4
    for batch in outputs:
        assert isinstance(batch["lr"], np.ndarray) and batch["lr"].shape == ()
        assert batch["lr"].dtype == np.float32 and batch["lr"] == np.float32(LR)
        assert batch["count"].dtype == np.int64 and batch["count"] == 1
        assert type(batch["plain"]) is float


class FullDatasetTrial(LrAndNanTrial):
    evaluate_batch = pytorch.PyTorchTrial.evaluate_batch  # evaluate_full_dataset only

    def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
        return {
            "val_loss": torch.tensor(math.nan),
            "lr": np.float32(LR),
            "plain": 0.5,
            "per_class": [torch.tensor(1.0), 2.0],
        }


def test_full_dataset_tensors_reach_callbacks_as_numpy_arrays(tmp_path):
    trial, result = _fit(FullDatasetTrial, tmp_path)
    end = trial.seen.end
    assert isinstance(end["val_loss"], np.ndarray) and end["val_loss"].dtype == np.float32
    assert math.isnan(end["val_loss"])
    assert type(end["lr"]) is np.float32 and type(end["plain"]) is float
    first, second = end["per_class"]  # Determined converts top-level tensors only
    assert isinstance(first, torch.Tensor) and second == 2.0
    reported = result.validation_metrics
    assert type(reported["val_loss"]) is float and math.isnan(reported["val_loss"])
    assert reported["lr"] == float(np.float32(LR)) and reported["per_class"] == [1.0, 2.0]


def _f32(*values: float) -> list[dict[str, Any]]:
    return [{"x": np.asarray(v, dtype=np.float32)} for v in values]


@pytest.mark.parametrize(
    ("reducer", "expected", "kind"),
    [
        (pytorch.Reducer.AVG, 7.0 / 3.0, np.float64),  # (1.5 * 2 + 4.0 * 1) / 3
        (pytorch.Reducer.SUM, 7.0, np.float32),
        (pytorch.Reducer.MAX, 4.0, np.float32),
        (pytorch.Reducer.MIN, 1.0, np.float32),
    ],
)
def test_slots_reduce_then_combine_weighted_by_their_batches(reducer, expected, kind):
    out = reduce_batch_metrics(reducer, [_f32(1.0, 2.0), _f32(4.0), []])
    assert type(out["x"]) is kind and out["x"] == expected


def test_one_slot_averages_in_float32():
    values = [0.1, 0.2, 0.7]
    out = reduce_batch_metrics(pytorch.Reducer.AVG, [_f32(*values)])
    assert type(out["x"]) is np.float32
    assert out["x"] == np.mean(np.array(values, dtype=np.float32))
