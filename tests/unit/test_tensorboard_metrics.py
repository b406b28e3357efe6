"""Issue 15 item 12: training and validation metrics go to TensorBoard event files the way
Determined's metric writer puts them there; enable_tensorboard_logging=False turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest

from det_tasks import pytorch, run_services
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial


def _train(tmp_path: Path, **init_kwargs) -> Path:
    tb = tmp_path / "tb"
    services = run_services.RunServices(
        InMemoryMetricsSink(), LocalDirectoryStore(tmp_path / "c"), str(tb)
    )
    with run_services.provide(services):
        ctx = pytorch.init(hparams={"global_batch_size": 4, "learning_rate": 0.1}, **init_kwargs)
        pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
            max_length=pytorch.Batch(4),
            reporting_period=pytorch.Batch(2),
            validation_period=pytorch.Batch(4),
            checkpoint_policy="none",
        )
    return tb


def _scalars(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_training_and_validation_metrics_are_written_as_determined_does(tmp_path):
    scalars = _scalars(_train(tmp_path))
    # y = w x on ones, w0 = 0, SGD lr 0.1: w_k = 1 - 0.8**k, so the loss of batch k is
    # (1 - w_k)**2 = 0.64**k, written per batch at step k; validation after 4 batches.
    assert [s for s, _ in scalars["Determined/loss"]] == [0, 1, 2, 3]
    for step, value in scalars["Determined/loss"]:
        assert value == pytest.approx(0.64**step, rel=1e-6)
    ((step, value),) = scalars["Determined/val_loss"]
    assert step == 4 and value == pytest.approx(0.64**4, rel=1e-6)


def test_disabled_logging_writes_no_events(tmp_path):
    tb = _train(tmp_path, enable_tensorboard_logging=False)
    assert not tb.exists() or not any(tb.rglob("events.out.tfevents.*"))


def test_without_the_tensorboard_package_it_warns_once(tmp_path, monkeypatch):
    import importlib.util

    from det_tasks.pytorch._loop import tensorboard as _tensorboard

    real = importlib.util.find_spec
    monkeypatch.setattr(
        _tensorboard.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    monkeypatch.setattr(_tensorboard, "_warned_missing", False)
    with pytest.warns(UserWarning, match="tensorboard package is missing") as caught:
        _train(tmp_path / "a")
        _train(tmp_path / "b")
    assert sum("tensorboard package is missing" in str(w.message) for w in caught) == 1
    assert not (tmp_path / "a" / "tb").exists()
