"""A held trial (det_tasks.runner.held) trains segment by segment in one process to the
same weights as ``det-tasks run`` segments resumed from checkpoints, even when other code
draws from the global RNG between its steps (dropout makes the trial depend on it)."""

from __future__ import annotations

import dataclasses
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from det_tasks.checkpoints import format as ckpt
from det_tasks.errors import ConfigError
from det_tasks.runner.held import HeldTrial, TrialSpec, entered_config, holdable, trial_config
from det_tasks.runner.in_process import run_trial

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn
    from det_tasks.pytorch import DataLoader, PyTorchTrial

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            gen = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 3, generator=gen)
            self.y = self.x.sum(1, keepdim=True)
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    class DropTrial(PyTorchTrial):
        def __init__(self, context):
            self.context = context
            net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
            self.model = context.wrap_model(net)
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.05))
        def build_training_data_loader(self):
            return DataLoader(Data(40), batch_size=4, shuffle=True)
        def build_validation_data_loader(self):
            return DataLoader(Data(8), batch_size=4)
        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}
        def evaluate_batch(self, batch):
            x, y = batch
            return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}
    """
)

CONFIG = textwrap.dedent(
    """
    name: held
    entrypoint: model_def:DropTrial
    hyperparameters: {global_batch_size: 4}
    searcher: {name: single, metric: validation_loss, max_length: {batches: 25}}
    reproducibility: {experiment_seed: 3}
    """
)


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_def.py").write_text(MODEL)
    (tmp_path / "model" / "config.yaml").write_text(CONFIG)
    return tmp_path / "model"


def _spec(model_dir: Path, store: Path) -> TrialSpec:
    return TrialSpec(
        config_path=str(model_dir / "config.yaml"),
        model_dir=str(model_dir),
        overrides=(f"checkpoint_storage={{type: shared_fs, host_path: {store}}}",),
        trial_id=1,
        hparams={"global_batch_size": 4},
    )


def _weights(path: str | Path) -> list[torch.Tensor]:
    state = ckpt.read_state(Path(path))
    return list(state["models_state_dict"][0].values())


def _disturb_global_rng() -> None:
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def test_held_segments_equal_resumed_processes(model_dir: Path, tmp_path: Path) -> None:
    spec = _spec(model_dir, tmp_path / "ref")
    first = run_trial(
        spec.config_path,
        model_dir,
        overrides=list(spec.overrides),
        hparams=spec.hparams,
        max_batches=7,
        progress=False,
    )
    ref = run_trial(
        spec.config_path,
        model_dir,
        overrides=list(spec.overrides),
        hparams=spec.hparams,
        max_batches=18,
        progress=False,
        latest_checkpoint=[str(first.checkpoint_uri)],
    )

    held = HeldTrial(_spec(model_dir, tmp_path / "held"))
    try:
        assert held.train_to(7) == 7
        _disturb_global_rng()
        first_metrics = held.validate()
        _disturb_global_rng()
        held.checkpoint()
        _disturb_global_rng()
        held.train_to(18)
        metrics = held.validate()
        _, uri = held.checkpoint()
        assert held.validate() is metrics  # once per position
    finally:
        held.close()
    assert first_metrics == first.validation_metrics
    assert metrics == ref.validation_metrics
    for a, b in zip(_weights(str(uri)), _weights(str(ref.checkpoint_uri)), strict=True):
        assert torch.equal(a, b)

    # Restored at 7 from its checkpoint and replayed to 18: the same weights again.
    again = HeldTrial(_spec(model_dir, tmp_path / "held"), resume=[str(first.checkpoint_uri)])
    try:
        assert again.position == 7
        assert again.validate() == first.validation_metrics  # read back from the checkpoint
        again.train_to(18)
        _, uri2 = again.checkpoint()
    finally:
        again.close()
    for a, b in zip(_weights(str(uri2)), _weights(str(ref.checkpoint_uri)), strict=True):
        assert torch.equal(a, b)


def test_script_entrypoints_are_not_held(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "train.py").write_text("print('hi')\n")
    spec = _spec(model_dir, tmp_path)
    spec = TrialSpec(
        **{**spec.__dict__, "overrides": (*spec.overrides, "entrypoint=python3 train.py")}
    )
    assert "script" in str(holdable(trial_config(spec)[1]))
    with pytest.raises(
        ConfigError, match="cannot be held in one process: its entrypoint is a script"
    ):
        HeldTrial(spec)


def test_a_worker_builds_the_trial_from_the_config_the_flow_parsed(
    model_dir: Path, tmp_path: Path
) -> None:
    """The flow's parsed config travels in the spec: the worker never reads the file (here
    gone), and the config's overrides are the ones the flow applied."""
    flow_config = entered_config(_spec(model_dir, tmp_path / "store"))
    (model_dir / "config.yaml").unlink()
    spec = dataclasses.replace(
        _spec(model_dir, tmp_path / "store"), overrides=(), config=flow_config
    )
    trial = HeldTrial(spec)
    try:
        assert trial.train_to(5) == 5
        _, uri = trial.checkpoint()
        assert Path(uri).parent == tmp_path / "store"  # the flow's override, not the file's
    finally:
        trial.close()


@pytest.mark.parametrize(("abandoned", "reported"), [(False, [1]), (True, [])])
def test_a_stop_reports_its_batches_unless_they_are_trained_again_elsewhere(
    model_dir: Path, tmp_path: Path, abandoned: bool, reported: list[int]
) -> None:
    """A stop at a batch boundary reports the training since the last report (a kill takes
    no checkpoint that would). A worker that closes abandons its step to be replayed from
    the last checkpoint on another worker: that stop reports nothing, or MLflow would hold
    those batches twice (a chaos run recorded training/loss at 30, 32 and 60)."""
    import threading

    held = HeldTrial(_spec(model_dir, tmp_path / "held"))
    try:
        stop, gone = threading.Event(), threading.Event()
        stop.set()
        if abandoned:
            gone.set()
        assert held.train_to(10, stop, gone) == 1
        assert [step for step, _ in held._controller.sink.training] == reported
    finally:
        held.close()
