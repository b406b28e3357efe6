"""A NaN/inf training loss never trains on silently: by default training goes on, as in
Determined, with a warning naming the batch and a count in the metrics; `error` stops
naming the batch before any checkpoint of the poisoned weights; `skip` drops exactly those
optimizer steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.errors import ConfigError, TrialError
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial


class PoisonedTrial(OneVarTrial):
    """The one-variable model, with a NaN (or inf) loss at chosen batches."""

    poisoned: tuple[int, ...] = (4,)
    value = float("nan")

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        loss = torch.nn.functional.mse_loss(self.model(data), labels)
        if batch_idx in self.poisoned:
            loss = loss * self.value
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        self.weights.append(float(self.model.weight.detach()))
        return {"loss": loss}


def fit(tmp_path, trial_class, policy: str | None, batches: int = 10, **conf: Any):
    optimizations = {"nonfinite_loss": policy} if policy else {}
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        exp_conf={"optimizations": {**optimizations, **conf}},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = trial_class(ctx)
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches),
        checkpoint_period=pytorch.Batch(2),
        checkpoint_policy="all",
    )
    return trial, sink


def test_default_trains_on_warns_once_and_counts_the_batches(tmp_path, caplog):
    trial, sink = fit(tmp_path, PoisonedTrial, None)
    # Closed form until batch 3; the NaN loss at batch 4 poisons the weight for good.
    w, expected = 0.0, []
    for _ in range(4):
        w = w + 2 * 0.1 * (1.0 - w)
        expected.append(w)
    assert trial.weights[:4] == pytest.approx(expected, abs=1e-6)
    assert len(trial.weights) == 10 and all(w != w for w in trial.weights[4:])  # NaN
    # Reports every 2 batches (the checkpoint period): batches 4..9 are non-finite. The
    # count is the platform's own metric, reported when non-zero, never a training metric.
    counts = [(group, step, m) for group, step, m in sink.groups]
    assert counts == [
        ("det_tasks", 6, {"nonfinite_loss_batches": 2}),
        ("det_tasks", 8, {"nonfinite_loss_batches": 2}),
        ("det_tasks", 10, {"nonfinite_loss_batches": 2}),
    ]
    assert [step for step, _ in sink.training] == [2, 4, 6, 8, 10]
    assert all(set(m) == {"loss"} for _, m in sink.training)
    warnings = [r for r in caplog.records if "NaN or infinite" in r.getMessage()]
    assert len(warnings) == 1 and "at batch 4" in warnings[0].getMessage()


def test_error_names_the_batch_and_writes_nothing_after_it(tmp_path):
    with pytest.raises(TrialError, match="NaN or infinite at batch 4"):
        fit(tmp_path, PoisonedTrial, "error")
    # Checkpoints at batches 2 and 4 only: the one due at batch 5 (after the NaN) is not.
    from det_tasks.checkpoints.format import read_json

    steps = sorted(
        read_json(p / "metadata.json")["steps_completed"]
        for p in tmp_path.iterdir()
        if not p.name.startswith(".")
    )
    assert steps == [2, 4]


def test_skip_drops_exactly_the_poisoned_steps(tmp_path):
    class InfTwice(PoisonedTrial):
        poisoned = (3, 7)
        value = float("inf")

    trial, _ = fit(tmp_path, InfTwice, "skip")
    w, expected = 0.0, []
    for batch in range(10):
        if batch not in (3, 7):
            w = w + 2 * 0.1 * (1.0 - w)
        expected.append(w)
    assert trial.weights == pytest.approx(expected, abs=1e-6)
    assert trial.context._nonfinite.skipped_batches == 2


def test_skip_with_aggregation_keeps_the_other_batch(tmp_path):
    trial, _ = fit(tmp_path, PoisonedTrial, "skip", batches=6, aggregation_frequency=2)
    # Steps after batches 1, 3, 5. A full window moves w by 2 * lr * (1 - w); in the last
    # window batch 4 is skipped, and batch 5's gradient alone is divided by the aggregation
    # frequency (Determined averages aggregated gradients), so w moves by lr * (1 - w).
    w, expected = 0.0, []
    for step in range(3):
        w = w + (0.1 if step == 2 else 0.2) * (1.0 - w)
        expected.append(w)
    assert trial.weights[1::2] == pytest.approx(expected, abs=1e-6)


def test_bad_policy_and_skip_with_workers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="nonfinite_loss = 'sometimes' is invalid"):
        fit(tmp_path, OneVarTrial, "sometimes")
    from det_tasks.pytorch._api.nonfinite import NonFiniteGuard

    with pytest.raises(ConfigError, match="not supported with 2 workers"):
        NonFiniteGuard("skip", torch.device("cpu"), 2)


def test_callbacks_and_other_sinks_see_only_the_users_keys(tmp_path):
    """Determined hands on_training_workload_end the user's metrics and nothing else; the
    count reaches every sink of a MultiSink that takes other groups, under its own group."""
    from det_tasks.sinks import MultiSink

    class Keys(pytorch.PyTorchCallback):
        def __init__(self) -> None:
            self.seen: list[set[str]] = []

        def on_training_workload_end(self, avg_metrics, batch_metrics) -> None:
            self.seen.append(set(avg_metrics) | {k for m in batch_metrics for k in m})

    class Watched(PoisonedTrial):
        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            self.keys = Keys()
            return {"keys": self.keys}

    first, second = InMemoryMetricsSink(), InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        metrics_sink=MultiSink(first, second),
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = Watched(ctx)
    pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(6), reporting_period=pytorch.Batch(3))
    assert trial.keys.seen == [{"loss"}, {"loss"}]
    for sink in (first, second):
        assert [set(m) for _, m in sink.training] == [{"loss"}, {"loss"}]
        assert sink.groups == [("det_tasks", 6, {"nonfinite_loss_batches": 2})]
