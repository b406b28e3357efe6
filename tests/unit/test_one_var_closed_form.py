"""The one-variable model: its weight after every SGD step has a closed form."""

from __future__ import annotations

import pytest

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial


def expected_weights(lr: float, steps: int) -> tuple[list[float], list[float]]:
    w, weights, losses = 0.0, [], []
    for _ in range(steps):
        losses.append((1.0 - w) ** 2)
        w = w + 2 * lr * (1.0 - w)
        weights.append(w)
    return weights, losses


@pytest.mark.parametrize("lr", [0.01, 0.1])
def test_weight_and_loss_follow_closed_form(tmp_path, lr):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": lr, "global_batch_size": 4},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = OneVarTrial(ctx)
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(12), reporting_period=pytorch.Batch(1), checkpoint_policy="none"
    )
    weights, losses = expected_weights(lr, 12)
    assert trial.weights == pytest.approx(weights, abs=1e-6)
    reported = [metrics["loss"] for _, metrics in sink.training]
    assert [step for step, _ in sink.training] == list(range(1, 13))
    assert reported == pytest.approx(losses, abs=1e-6)
    # Final validation at the end: loss of the final weight on (1, 1).
    assert sink.validation[-1][0] == 12
    assert sink.validation[-1][1]["val_loss"] == pytest.approx((1 - weights[-1]) ** 2, abs=1e-6)
