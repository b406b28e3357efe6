"""Checkpoints written in the background: training goes on while the state is serialised and
published, the checkpoint still holds the weights of its own batch, a failed write publishes
nothing, and on_checkpoint_write_end callbacks keep Determined's meaning."""

from __future__ import annotations

import collections
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from det_tasks import CheckpointError, pytorch
from det_tasks.checkpoints import format as checkpoint_format
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import PyTorchCallback
from det_tasks.pytorch._loop.checkpointing import snapshot
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial

LR = 0.1


def closed_form(batches: int) -> float:
    w = 0.0
    for _ in range(batches):
        w = w + 2 * LR * (1.0 - w)
    return w


class HeldStore(LocalDirectoryStore):
    """Publishing waits until the trial has trained ``release_at`` batches (or times out):
    a synchronous write would have the training thread wait on itself."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.released_in_time: list[bool] = []

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        self.released_in_time.append(self.release.wait(timeout=10))
        return super().publish(staged, metadata)


class ReleasingTrial(OneVarTrial):
    release_at = 4
    store: HeldStore

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        if batch_idx == self.release_at:
            self.store.release.set()
        return super().train_batch(batch, epoch_idx, batch_idx)


def fit(trial_class: type, store: LocalDirectoryStore, batches: int, **kwargs: Any) -> Any:
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": LR, "global_batch_size": 4},
        metrics_sink=sink,
        checkpoint_store=store,
    )
    trial = trial_class(ctx)
    trial.store = store
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches), checkpoint_policy="none", **kwargs
    )
    return trial, sink


def saved_weight(store: LocalDirectoryStore, uuid: str) -> float:
    state = checkpoint_format.read_state(store.path_of(uuid))
    return float(state["models_state_dict"][0]["weight"])


def test_training_goes_on_while_the_checkpoint_is_written(tmp_path: Path) -> None:
    store = HeldStore(tmp_path)
    _, sink = fit(ReleasingTrial, store, 8, checkpoint_period=pytorch.Batch([2, 6]))
    # The checkpoint after batch 2 was published only once batch 4 had started training.
    assert store.released_in_time[0] is True
    by_step = {c.steps_completed: c.uuid for c in sink.checkpoints}
    assert sorted(by_step) == [2, 6, 8]
    for step, uuid in by_step.items():  # each holds its own batch's weight, not a later one
        assert saved_weight(store, uuid) == pytest.approx(closed_form(step), abs=1e-7)
        checkpoint_format.verify(store.path_of(uuid))


class FailingStore(LocalDirectoryStore):
    """Fails the second checkpoint's write in the background (after half the bytes)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.published = 0

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        if metadata["steps_completed"] == 4:
            state_file = staged / checkpoint_format.STATE_FILE
            state_file.write_bytes(state_file.read_bytes()[:100])
            raise OSError(28, "No space left on device")
        return super().publish(staged, metadata)


def test_a_failed_background_write_publishes_nothing(tmp_path: Path) -> None:
    store = FailingStore(tmp_path)
    with pytest.raises(CheckpointError) as err:
        fit(OneVarTrial, store, 8, checkpoint_period=pytorch.Batch(2))
    assert "at batch 4" in str(err.value) and "No space left on device" in str(err.value)
    published = [p for p in tmp_path.iterdir() if (p / "metadata.json").exists()]
    assert len(published) == 1  # batch 2's; nothing of batch 4's is left
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [published[0].name]
    assert checkpoint_format.verify(published[0])["steps_completed"] == 2
    assert saved_weight(store, published[0].name) == pytest.approx(closed_form(2), abs=1e-7)


class AddsAFile(PyTorchCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[bool, float]] = []
        self.model: torch.nn.Module | None = None

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        path = Path(checkpoint_dir)
        assert self.model is not None
        self.seen.append(((path / "state_dict.pth").is_file(), float(self.model.weight.detach())))
        (path / "extra.txt").write_text("added by a callback")


class CallbackTrial(OneVarTrial):
    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.callback = AddsAFile()
        self.callback.model = self.model

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        return {"adds": self.callback}


def test_write_end_callbacks_see_files_and_the_checkpoint_weights(tmp_path: Path) -> None:
    trial, sink = fit(
        CallbackTrial, LocalDirectoryStore(tmp_path), 4, checkpoint_period=pytorch.Batch(2)
    )
    # The files exist, and the model is still at the checkpoint's weights (the write is
    # synchronous for such callbacks, as in Determined).
    assert trial.callback.seen == [
        (True, pytest.approx(closed_form(2), abs=1e-7)),
        (True, pytest.approx(closed_form(4), abs=1e-7)),
    ]
    for reported in sink.checkpoints:
        meta = checkpoint_format.verify(tmp_path / reported.uuid)
        assert "extra.txt" in meta["files"]


def test_snapshot_saves_byte_identical_files() -> None:
    """Views and tied weights keep sharing storage, state_dict()'s _metadata survives, and
    later in-place changes to the live tensors do not reach the snapshot."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    base = torch.arange(12.0)
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "views": [base, base[2:6], base.view(3, 4)],
        "counts": collections.Counter(a=1),
        "rng": torch.random.get_rng_state(),
    }
    copy = snapshot(state)
    live, copied = io.BytesIO(), io.BytesIO()
    torch.save(state, live)
    torch.save(copy, copied)
    assert live.getvalue() == copied.getvalue()
    assert copy["model"]._metadata == state["model"]._metadata
    with torch.no_grad():
        model[0].weight.add_(1.0)
    base.zero_()
    assert not torch.equal(copy["model"]["0.weight"], model[0].weight)
    assert copy["views"][1].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert (
        copy["views"][1].untyped_storage().data_ptr()
        == copy["views"][0].untyped_storage().data_ptr()
    )
