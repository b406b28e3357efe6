"""Callback hooks: which run, how often, and in what order, for batch and epoch periods."""

from __future__ import annotations

import pytest

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import CountingCallback, OneVarTrial

CKPT = [
    ("on_checkpoint_save_start", None),
    ("on_checkpoint_write_end", None),
    ("on_checkpoint_upload_end", None),
]
VALIDATE = [
    ("on_validation_start", None),
    ("on_validation_epoch_start", None),
    ("on_validation_epoch_end", 1),
    ("on_validation_end", None),
]


class CallbackTrial(OneVarTrial):
    def __init__(self, context):
        super().__init__(context)
        self.counter = CountingCallback()

    def build_callbacks(self):
        return {"counter": self.counter}


def fit(tmp_path, **kwargs):
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 16},
        metrics_sink=InMemoryMetricsSink(),
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = CallbackTrial(ctx)  # 64 records / 16 = 4 batches per epoch
    pytorch.Trainer(trial, ctx).fit(checkpoint_policy="none", **kwargs)
    return trial.counter.calls


def test_hook_order_with_epoch_validation_and_batch_checkpoints(tmp_path):
    calls = fit(
        tmp_path,
        max_length=pytorch.Epoch(2),
        validation_period=pytorch.Epoch(1),
        checkpoint_period=pytorch.Batch(3),
        reporting_period=pytorch.Batch(2),
    )
    wl = "on_training_workload_end"
    expected = [
        ("on_trial_startup", 0),
        ("on_training_start", None),
        ("on_training_epoch_start", 0),
        (wl, 2),  # batch 2: report
        (wl, 1),
        *CKPT,  # batch 3: checkpoint
        ("on_training_epoch_end", 0),
        (wl, 1),
        *VALIDATE,  # batch 4: epoch end
        ("on_training_epoch_start", 1),
        (wl, 2),
        *CKPT,  # batch 6: report + checkpoint
        ("on_training_epoch_end", 1),
        (wl, 2),
        *VALIDATE,  # batch 8
        *CKPT,  # end of training: final checkpoint
        ("on_trial_shutdown", None),
    ]
    assert calls == expected


@pytest.mark.parametrize(
    ("max_length", "validation", "checkpoint", "validations", "checkpoints"),
    [
        (pytorch.Batch(12), pytorch.Batch(4), pytorch.Batch(6), 3, 2),
        (pytorch.Epoch(3), pytorch.Epoch(1), pytorch.Epoch(2), 3, 2),
        (pytorch.Batch(10), pytorch.Batch([3, 7]), None, 3, 1),
    ],
)
def test_hook_counts(tmp_path, max_length, validation, checkpoint, validations, checkpoints):
    calls = fit(
        tmp_path, max_length=max_length, validation_period=validation, checkpoint_period=checkpoint
    )
    names = [name for name, _ in calls]
    assert names.count("on_validation_end") == validations
    assert names.count("on_checkpoint_upload_end") == checkpoints
    assert names.count("on_trial_startup") == names.count("on_trial_shutdown") == 1


def test_step_zero_validation_runs_before_training(tmp_path):
    calls = fit(tmp_path, max_length=pytorch.Batch(2), step_zero_validation=True)
    names = [name for name, _ in calls]
    assert names[:3] == ["on_trial_startup", "on_training_start", "on_validation_start"]
    assert names.index("on_validation_end") < names.index("on_training_epoch_start")


def test_shutdown_runs_when_training_raises(tmp_path):
    class Exploding(CallbackTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().train_batch(batch, epoch_idx, batch_idx)

    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 16},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = Exploding(ctx)
    with pytest.raises(RuntimeError, match="boom"):
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(5), checkpoint_policy="none")
    assert trial.counter.calls[-1] == ("on_trial_shutdown", None)
