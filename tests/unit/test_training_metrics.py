"""Training metrics as Determined computes them: non-scalar values averaged over every
element, custom reducers fresh for every training window and every validation."""

from __future__ import annotations

import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader
from det_tasks.pytorch._loop.metrics import average_metric
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OnesDataset, OneVarTrial


def fit(tmp_path, trial_class, batches, **periods):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    pytorch.Trainer(trial_class(ctx), ctx).fit(
        max_length=pytorch.Batch(batches), checkpoint_policy="none", **periods
    )
    return sink


class NonScalarTrial(OneVarTrial):
    def train_batch(self, batch, epoch_idx, batch_idx):
        metrics = super().train_batch(batch, epoch_idx, batch_idx)
        b = float(batch_idx)
        metrics["vector"] = torch.tensor([b, 2 * b])
        metrics["matrix"] = torch.full((2, 2), b).numpy()
        metrics["flag"] = torch.tensor(batch_idx % 2 == 1)
        metrics["tag"] = "text"
        return metrics


def test_non_scalar_metrics_are_averaged_over_every_element(tmp_path, caplog):
    sink = fit(tmp_path, NonScalarTrial, 8, reporting_period=pytorch.Batch(4))
    (_, metrics) = sink.training[0]
    assert metrics["vector"] == pytest.approx((0 + 1 + 2 + 3) * 3 / 8)  # 2.25
    assert metrics["matrix"] == pytest.approx(1.5)
    assert metrics["flag"] == pytest.approx(0.5)
    assert "tag" in metrics and metrics["tag"] is None  # kept, as Determined, not averaged
    assert sink.training[1][1]["vector"] == pytest.approx((4 + 5 + 6 + 7) * 3 / 8)
    warned = [r for r in caplog.records if "'tag' cannot be averaged" in r.getMessage()]
    assert len(warned) == 1  # once per metric, not per report


def test_average_metric_leaves_out_nones_and_refuses_ragged_values():
    assert average_metric([1.0, None, 3.0]) == pytest.approx(2.0)
    assert average_metric([[1.0, 2.0], [3.0]]) is None


class CountingReducerTrial(OneVarTrial):
    """A sum reducer fed 1 per training batch and 100 per validation batch."""

    def __init__(self, context):
        super().__init__(context)
        self.count = context.wrap_reducer(lambda values: sum(values), name="count")

    def train_batch(self, batch, epoch_idx, batch_idx):
        self.count.update(1)
        return super().train_batch(batch, epoch_idx, batch_idx)

    def evaluate_batch(self, batch):
        self.count.update(100)
        return super().evaluate_batch(batch)

    def build_validation_data_loader(self):
        return DataLoader(OnesDataset(8), batch_size=4)  # 2 batches


def test_reducers_are_fresh_for_every_training_window_and_validation(tmp_path):
    sink = fit(
        tmp_path,
        CountingReducerTrial,
        6,
        reporting_period=pytorch.Batch(2),
        validation_period=pytorch.Batch(2),
    )
    # Validation updates (2 x 100) never leak into the next training window, and training
    # updates never into a validation.
    assert [m["count"] for _, m in sink.training] == [2, 2, 2]
    assert [m["count"] for _, m in sink.validation] == [200, 200, 200]
