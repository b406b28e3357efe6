"""The global RNG streams a trial sees match Determined's: seeded before the trial is
built, then one int64 drawn from the torch generator when the training iterator is
created (before a checkpoint's RNG state is restored) and one when each validation's
iterator is created. So ``torch.rand`` inside train_batch/evaluate_batch gives Determined's
numbers, and a resumed run still continues the uninterrupted run's streams exactly."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader
from tests.fixtures.trials import OnesDataset, OneVarTrial

SEED = 7


class DrawingTrial(OneVarTrial):
    """Records a torch, a numpy and a Python draw in every train and evaluate batch."""

    def __init__(self, context):
        super().__init__(context)
        self.train_draws: list[tuple[float, float, float]] = []
        self.eval_draws: list[tuple[float, float, float]] = []

    @staticmethod
    def _draw() -> tuple[float, float, float]:
        return (torch.rand(()).item(), float(np.random.rand()), random.random())

    def train_batch(self, batch, epoch_idx, batch_idx):
        self.train_draws.append(self._draw())
        return super().train_batch(batch, epoch_idx, batch_idx)

    def evaluate_batch(self, batch):
        self.eval_draws.append(self._draw())
        return super().evaluate_batch(batch)

    def build_validation_data_loader(self):
        return DataLoader(OnesDataset(8), batch_size=4)  # 2 batches


def determined_streams(train_batches: int, validate_every: int):
    """Determined 0.38.1's sequence, spelled out: seed; build the trial (nn.Linear's init
    draws); create the training iterator (one int64); train; each validation creates its
    iterator (one int64) and evaluates 2 batches."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    nn.Linear(1, 1, bias=False)
    torch.empty((), dtype=torch.int64).random_()
    train, evaluate = [], []
    for batch in range(train_batches):
        train.append(DrawingTrial._draw())
        if (batch + 1) % validate_every == 0:
            torch.empty((), dtype=torch.int64).random_()
            evaluate.extend(DrawingTrial._draw() for _ in range(2))
    return train, evaluate


def fit(tmp_path, batches, latest=None):
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        seed=SEED,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = DrawingTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches),
        validation_period=pytorch.Batch(3),
        checkpoint_period=pytorch.Batch(3),
        checkpoint_policy="none",
        latest_checkpoint=latest,
    )
    return trial, result


def test_draws_in_train_and_evaluate_batch_match_determineds_sequence(tmp_path):
    trial, _ = fit(tmp_path, 6)
    train, evaluate = determined_streams(6, validate_every=3)
    assert trial.train_draws == train
    assert trial.eval_draws == evaluate
    # The first torch draw, as a literal: seed 7, Linear init, one int64, then rand();
    # without the iterator's int64 it would be 0.19880318641662598.
    assert trial.train_draws[0][0] == 0.6568902730941772


def test_resumed_run_continues_the_uninterrupted_streams(tmp_path):
    full, _ = fit(tmp_path / "full", 9)
    _, first = fit(tmp_path / "part", 3)
    resumed, _ = fit(tmp_path / "part", 9, latest=first.checkpoint_uuid)
    assert resumed.train_draws == full.train_draws[3:]
    assert resumed.eval_draws == full.eval_draws[2:]


def test_evaluate_full_dataset_iterates_on_the_global_generator(tmp_path):
    class FullDataset(DrawingTrial):
        evaluate_batch = pytorch.PyTorchTrial.evaluate_batch

        def evaluate_full_dataset(self, data_loader):
            for _ in data_loader:  # creating the iterator draws one int64, as Determined's
                self.eval_draws.append(self._draw())
            return {"n": len(self.eval_draws)}

    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        seed=SEED,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = FullDataset(ctx)
    pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(3), checkpoint_policy="none")
    _, evaluate = determined_streams(3, validate_every=3)
    assert trial.eval_draws == evaluate
