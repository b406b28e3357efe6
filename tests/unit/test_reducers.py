"""Validation reduction: Reducer AVG/SUM/MAX/MIN, function reducers, MetricReducer
subclasses (training and validation), and evaluate_full_dataset."""

from __future__ import annotations

import pytest
import torch

from det_tasks import TrialError, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader, MetricReducer, Reducer
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial

VALUES = torch.arange(1.0, 13.0)  # validation records 1..12, batch size 4 -> 3 batches


class SumAndCount(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.sum, self.count = 0.0, 0

    def update(self, values):
        self.sum += float(values.sum())
        self.count += len(values)

    def per_slot_reduce(self):
        return self.sum, self.count

    def cross_slot_reduce(self, per_slot_metrics):
        sums, counts = zip(*per_slot_metrics)
        return {"record_mean": sum(sums) / sum(counts), "records": sum(counts)}


class ReducingTrial(OneVarTrial):
    def __init__(self, context):
        super().__init__(context)
        self.median = context.experimental.wrap_reducer(
            lambda values: float(torch.cat(values).median()), name="median", for_training=False
        )
        self.custom = context.experimental.wrap_reducer(SumAndCount(), for_training=False)
        self.train_records = context.experimental.wrap_reducer(
            lambda values: sum(values), name="train_records", for_validation=False
        )

    def train_batch(self, batch, epoch_idx, batch_idx):
        self.train_records.update(len(batch[0]))
        return super().train_batch(batch, epoch_idx, batch_idx)

    def build_validation_data_loader(self):
        return DataLoader(torch.utils.data.TensorDataset(VALUES), batch_size=4)

    def evaluate_batch(self, batch):
        (values,) = batch
        self.median.update(values)
        self.custom.update(values)
        mean = values.mean()
        return {"avg": mean, "sum": mean, "max": mean, "min": mean}

    def evaluation_reducer(self):
        return {"avg": Reducer.AVG, "sum": Reducer.SUM, "max": Reducer.MAX, "min": Reducer.MIN}


class FullDatasetTrial(OneVarTrial):
    evaluate_batch = pytorch.PyTorchTrial.evaluate_batch

    def build_validation_data_loader(self):
        return DataLoader(torch.utils.data.TensorDataset(VALUES), batch_size=5)

    def evaluate_full_dataset(self, data_loader):
        seen = torch.cat([values for (values,) in data_loader])
        return {"total": seen.sum(), "n": len(seen)}


def validate(trial_cls, tmp_path, batches=4):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 8},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    pytorch.Trainer(trial_cls(ctx), ctx).fit(
        max_length=pytorch.Batch(batches),
        reporting_period=pytorch.Batch(2),
        checkpoint_policy="none",
    )
    return sink


def test_builtin_function_and_custom_reducers(tmp_path):
    sink = validate(ReducingTrial, tmp_path)
    _step, metrics = sink.validation[-1]
    # Batch means are 2.5, 6.5, 10.5.
    assert metrics["avg"] == pytest.approx(6.5)
    assert metrics["sum"] == pytest.approx(19.5)
    assert metrics["max"] == pytest.approx(10.5)
    assert metrics["min"] == pytest.approx(2.5)
    assert metrics["median"] == pytest.approx(6.0)  # torch's lower median of 1..12
    assert metrics["record_mean"] == pytest.approx(6.5)
    assert metrics["records"] == 12
    # The training-only reducer counts records per reporting window (2 batches of 8).
    assert [m["train_records"] for _, m in sink.training] == [16, 16]
    assert "train_records" not in metrics


def test_evaluate_full_dataset(tmp_path):
    sink = validate(FullDatasetTrial, tmp_path)
    assert sink.validation[-1][1] == {"total": pytest.approx(78.0), "n": 12}


def test_reducer_dict_missing_a_metric_is_a_clear_error(tmp_path):
    class Missing(ReducingTrial):
        def evaluation_reducer(self):
            return {"avg": Reducer.AVG}

    with pytest.raises(TrialError, match="without metric 'sum'"):
        validate(Missing, tmp_path)


def test_overriding_both_evaluation_methods_is_refused(tmp_path):
    class Both(ReducingTrial):
        def evaluate_full_dataset(self, data_loader):
            return {}

    with pytest.raises(TrialError, match="exactly one of evaluate_batch"):
        validate(Both, tmp_path)
