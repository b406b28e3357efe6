"""Exact resume: a run resumed mid-epoch from a checkpoint matches an uninterrupted run
bit for bit (RNG, data position, optimizer, LR scheduler, callbacks)."""

from __future__ import annotations

import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import NoisyMLPTrial

HPARAMS = {"global_batch_size": 8}


def run(tmp_path, max_batches, latest=None):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams=HPARAMS, seed=7, metrics_sink=sink, checkpoint_store=LocalDirectoryStore(tmp_path)
    )
    trial = NoisyMLPTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(max_batches),
        reporting_period=pytorch.Batch(1),
        checkpoint_policy="none",
        latest_checkpoint=latest,
    )
    return trial, sink, result


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    full_trial, full_sink, _ = run(tmp_path / "a", 30)
    # 96 records / 8 = 12 batches per epoch: batch 17 is mid-way through epoch 1.
    _first_trial, _first_sink, first = run(tmp_path / "b", 17)
    assert first.batches_trained == 17
    resumed_trial, resumed_sink, _resumed = run(tmp_path / "b", 30, latest=first.checkpoint_uuid)

    full_after = [(s, m) for s, m in full_sink.training if s > 17]
    assert [s for s, _ in resumed_sink.training] == list(range(18, 31))
    assert resumed_sink.training == full_after  # loss, RNG draw and LR: exactly equal
    assert [m["lr"] for _, m in resumed_sink.training] == [m["lr"] for _, m in full_after]
    for a, b in zip(
        full_trial.model.state_dict().values(), resumed_trial.model.state_dict().values()
    ):
        assert torch.equal(a, b)
    for a, b in zip(
        full_trial.opt.state_dict()["state"].values(),
        resumed_trial.opt.state_dict()["state"].values(),
    ):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_resume_restores_callback_state_and_starts_at_the_right_batch(tmp_path):
    _, _, first = run(tmp_path, 17)
    resumed_trial, _, _ = run(tmp_path, 20, latest=first.checkpoint_uuid)
    counter = resumed_trial.counter
    # Determined's order: startup (knowing the first batch), then the checkpoint's state.
    assert counter.calls[0] == ("on_trial_startup", 17)
    assert counter.calls[1] == ("on_checkpoint_load_start", None)
    # One validation in the first run (saved), one at the end of the resumed one.
    assert counter.validations_seen == 2


def test_resume_does_not_replay_data(tmp_path):
    """The resumed run reads batches 17.. of the shuffled order, never batch 0 again."""
    seen: list[list[float]] = []

    class Recording(NoisyMLPTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            seen.append(batch[1].tolist())
            return super().train_batch(batch, epoch_idx, batch_idx)

    sink = InMemoryMetricsSink()
    store = LocalDirectoryStore(tmp_path)
    ctx = pytorch.init(hparams=HPARAMS, seed=7, metrics_sink=sink, checkpoint_store=store)
    pytorch.Trainer(Recording(ctx), ctx).fit(max_length=pytorch.Batch(24), checkpoint_policy="none")
    full = list(seen)
    seen.clear()
    ctx = pytorch.init(hparams=HPARAMS, seed=7, metrics_sink=sink, checkpoint_store=store)
    first = pytorch.Trainer(Recording(ctx), ctx).fit(
        max_length=pytorch.Batch(5), checkpoint_policy="none"
    )
    seen.clear()
    ctx = pytorch.init(hparams=HPARAMS, seed=7, metrics_sink=sink, checkpoint_store=store)
    pytorch.Trainer(Recording(ctx), ctx).fit(
        max_length=pytorch.Batch(24),
        checkpoint_policy="none",
        latest_checkpoint=first.checkpoint_uuid,
    )
    assert seen == full[5:]
