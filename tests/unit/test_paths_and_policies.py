"""Issue 15 item 11: checkpoint paths callbacks see, reset_parameters, CheckpointLoadContext."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from det_tasks import pytorch
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import PyTorchCallback, load_trial_from_checkpoint_path
from tests.fixtures.trials import OneVarTrial


class _RecordsPath(PyTorchCallback):
    def __init__(self) -> None:
        self.paths: list[str] = []

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self.paths.append(checkpoint_dir)


class _Trial(OneVarTrial):
    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        return {"paths": self.recorder}


def test_checkpoint_write_end_path_is_named_by_uuid_and_resumable(tmp_path):
    ctx = pytorch.init(
        hparams={"global_batch_size": 4, "learning_rate": 0.1},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = _Trial(ctx)
    trial.recorder = _RecordsPath()
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(3), checkpoint_policy="none")
    (path,) = trial.recorder.paths
    assert Path(path).name == result.checkpoint_uuid
    assert Path(path) == tmp_path.resolve() / result.checkpoint_uuid
    assert ckpt.verify(Path(path))["steps_completed"] == 3  # still there, sealed
    # A callback that kept the path can load (or resume) from it.
    again = load_trial_from_checkpoint_path(path, trial_class=OneVarTrial)
    assert float(again.model.weight.detach()) == trial.weights[-1]


class _Affine(nn.Module):
    """A root module with its own reset_parameters and parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(5.0))
        self.inner = nn.Linear(1, 1)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


def test_reset_parameters_resets_the_root_module_too():
    model = _Affine()
    with torch.no_grad():
        model.inner.weight.fill_(7.0)
    pytorch.reset_parameters(model)
    assert float(model.scale.detach()) == 1.0
    assert float(model.inner.weight) != 7.0


class _AmpTrial(OneVarTrial):
    def __init__(self, context: Any) -> None:
        context.experimental.use_amp()
        super().__init__(context)
        self.model, self.opt = context.configure_apex_amp(self.model, self.opt, opt_level="O1")


def test_checkpoint_load_context_does_no_training_side_wrapping(tmp_path):
    ctx = pytorch.init(
        hparams={"global_batch_size": 4, "learning_rate": 0.1},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = OneVarTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(2), checkpoint_policy="none")
    loaded = load_trial_from_checkpoint_path(
        tmp_path / result.checkpoint_uuid, trial_class=_AmpTrial
    )
    # No autocast patched onto forward, no scaler: inference runs in fp32, exactly.
    assert "forward" not in vars(loaded.model)
    assert loaded.context._scaler is None
    out = loaded.model(torch.tensor([[3.0]]))
    assert out.dtype == torch.float32
    assert float(out) == 3.0 * trial.weights[-1]


def _controller(tmp_path, experiment_best):
    from det_tasks.pytorch._loop.loop import FitOptions, TrialController
    from det_tasks.sinks import InMemoryMetricsSink

    ctx = pytorch.init(
        hparams={"global_batch_size": 4, "learning_rate": 0.1},
        exp_conf={"searcher": {"name": "random", "metric": "val_loss"}},
    )
    sink = InMemoryMetricsSink()
    options = FitOptions(
        max_length=pytorch.Batch(4),
        validation_period=pytorch.Batch(1),
        checkpoint_policy="best",
        searcher_metric="val_loss",
    )
    controller = TrialController(
        OneVarTrial(ctx), ctx, options, sink, LocalDirectoryStore(tmp_path)
    )
    controller.experiment_best = experiment_best
    controller.run()
    return controller, sink


def test_best_policy_under_a_search_compares_with_the_experiment_best(tmp_path):
    # val_loss after k batches is 0.64**k: 0.64, 0.41, 0.26, 0.17.
    _, alone_sink = _controller(tmp_path / "a", None)
    assert [c.steps_completed for c in alone_sink.checkpoints] == [1, 2, 3, 4]
    # Another trial already reached 0.3: only the validations below it checkpoint (3 and 4).
    searched, sink = _controller(tmp_path / "b", 0.3)
    assert [c.steps_completed for c in sink.checkpoints] == [3, 4]
    assert searched.best_metric == pytest.approx(0.64**4)
