"""Callbacks written for older Determined: hooks without the arguments added later
(``on_training_epoch_start(self)`` before 0.17.8, ...) run, called with what they accept."""

from __future__ import annotations

import pytest

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.errors import TrialError
from det_tasks.pytorch import PyTorchCallback
from tests.fixtures.trials import OneVarTrial


class OldStyleCallback(PyTorchCallback):
    def __init__(self):
        self.calls: list[str] = []

    def on_trial_startup(self):  # type: ignore[override]
        self.calls.append("startup")

    def on_training_epoch_start(self):  # type: ignore[override]
        self.calls.append("epoch_start")

    def on_training_epoch_end(self):  # type: ignore[override]
        self.calls.append("epoch_end")

    def on_training_workload_end(self, avg_metrics):  # type: ignore[override]
        self.calls.append(f"workload {sorted(avg_metrics)}")

    def on_validation_end(self):  # type: ignore[override]
        self.calls.append("validation_end")

    def on_checkpoint_upload_end(self):  # type: ignore[override]
        self.calls.append("uploaded")


class NeedsTooMuch(PyTorchCallback):
    def on_validation_end(self, metrics, extra):  # type: ignore[override]
        pass


def run(tmp_path, callback):
    class Trial(OneVarTrial):
        def build_callbacks(self):
            return {"cb": callback}

    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 16},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    # 64 records / 16 = 4 batches per epoch; 2 epochs, report every 4, validate at the end.
    pytorch.Trainer(Trial(ctx), ctx).fit(
        max_length=pytorch.Epoch(2), reporting_period=pytorch.Batch(4), checkpoint_policy="none"
    )


def test_older_hook_signatures_are_called_with_what_they_accept(tmp_path, caplog):
    cb = OldStyleCallback()
    run(tmp_path, cb)
    assert cb.calls == [
        "startup",
        "epoch_start",
        "epoch_end",
        "workload ['loss']",
        "epoch_start",
        "epoch_end",
        "workload ['loss']",
        "validation_end",
        "uploaded",
    ]
    assert "on_training_epoch_start takes 0 of its 1 arguments" in caplog.text


def test_a_hook_needing_more_arguments_than_passed_is_named(tmp_path):
    with pytest.raises(TrialError, match="'cb': on_validation_end requires 2 arguments"):
        run(tmp_path, NeedsTooMuch())


def test_the_users_callback_object_is_left_untouched(tmp_path):
    """Determined adapts the call in its dispatch; the instance keeps only its own state
    (no per-hook wrapper written into its __dict__), for every legacy hook."""
    cb = OldStyleCallback()
    before = type(cb).__dict__.copy()
    run(tmp_path, cb)
    assert set(vars(cb)) == {"calls"}
    assert type(cb).__dict__ == before
    for hook in ("on_trial_startup", "on_training_epoch_start", "on_validation_end"):
        assert getattr(cb, hook).__func__ is getattr(OldStyleCallback, hook)


def test_a_legacy_callback_keeps_its_checkpointed_state(tmp_path):
    """Behind the harness's handle, state_dict/load_state_dict are still the callback's."""

    class Counter(PyTorchCallback):
        def __init__(self) -> None:
            self.epochs = 0

        def on_training_epoch_start(self):  # type: ignore[override]
            self.epochs += 1

        def state_dict(self):
            return {"epochs": self.epochs}

        def load_state_dict(self, state_dict):
            self.epochs = state_dict["epochs"]

    first = Counter()
    run(tmp_path, first)
    assert first.epochs == 2 and set(vars(first)) == {"epochs"}
    from det_tasks.checkpoints.format import read_state

    (checkpoint,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert read_state(checkpoint)["callbacks"] == {"cb": {"epochs": 2}}
