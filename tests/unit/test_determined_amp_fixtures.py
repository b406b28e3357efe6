"""Determined's one-variable AMP fixtures, in their shape: they read the private
``context._aggregation_frequency`` in ``__init__`` (to size their data), the automatic one
replaces ``context._scaler`` after ``use_amp()``, the manual one wraps a
``torch.cuda.amp.GradScaler`` and autocasts itself. On CPU both scalers are pass-throughs
(AMP is CUDA-only, as in Determined), so the weight follows the closed form."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from tests.fixtures.trials import OnesDataset, OneVarTrial

LR = 0.1


class RepeatedOnes(OnesDataset):
    """Each record repeated ``agg`` times, so every optimizer step sees the same data."""

    def __init__(self, agg: int) -> None:
        super().__init__(8 * agg)


class AggregationAwareTrial(OneVarTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        super().__init__(context)
        self.agg = self.context._aggregation_frequency  # as Determined's fixture does

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(RepeatedOnes(self.agg), batch_size=1)


class AutoAMPTrial(AggregationAwareTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        context.experimental.use_amp()
        context._scaler = torch.cuda.amp.GradScaler(init_scale=65536, growth_interval=4)
        super().__init__(context)
        self.scaler = self.context._scaler


class ManualAMPTrial(AggregationAwareTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.scaler = context.wrap_scaler(
            torch.cuda.amp.GradScaler(init_scale=65536, growth_interval=4)
        )
        super().__init__(context)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        with torch.cuda.amp.autocast():
            loss = torch.nn.functional.mse_loss(self.model(data), labels)
        self.context.backward(self.scaler.scale(loss))
        self.context.step_optimizer(self.opt, scaler=self.scaler)
        if (batch_idx + 1) % self.agg == 0:
            self.scaler.update()
        self.weights.append(float(self.model.weight.detach()))
        return {"loss": loss, "scale": self.scaler.get_scale()}


@pytest.mark.parametrize("trial_class", [AutoAMPTrial, ManualAMPTrial], ids=["auto", "manual"])
@pytest.mark.parametrize("agg", [1, 2])
def test_amp_fixture_trains_to_the_closed_form(tmp_path, trial_class, agg):
    ctx = pytorch.init(
        hparams={"learning_rate": LR, "global_batch_size": 1},
        exp_conf={"optimizations": {"aggregation_frequency": agg}},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp's deprecation and no-CUDA notes
        trial = trial_class(ctx)
        assert trial.agg == agg
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(4 * agg))
    w, expected = 0.0, []
    for _ in range(4):
        w = w + 2 * LR * (1.0 - w)
        expected += [w] * agg
    # Within an aggregation window the weight moves only at the window's last batch.
    observed = trial.weights[agg - 1 :: agg]
    assert observed == pytest.approx(expected[agg - 1 :: agg], abs=1e-6)
