"""A held trial's training loop stops on the runner's one ``TrialControl``
(det_tasks.run_services), the object a Core API script's ``should_preempt()`` reads too: a
stop request ends the step at the next batch boundary, an abandoned one reports nothing,
a spent request no longer stops the next step, and training under an unset control is bit for bit
the training without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from det_tasks.checkpoints import format as ckpt
from det_tasks.run_services import TrialControl
from det_tasks.runner.held import HeldTrial, TrialSpec
from tests.unit.test_held_trial import CONFIG, MODEL


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_def.py").write_text(MODEL)
    (model / "config.yaml").write_text(CONFIG)
    return model


def _held(model_dir: Path, store: Path) -> HeldTrial:
    store_override = f"checkpoint_storage={{type: shared_fs, host_path: {store}}}"
    spec = TrialSpec(
        str(model_dir / "config.yaml"),
        str(model_dir),
        (store_override,),
        1,
        {"global_batch_size": 4},
    )
    return HeldTrial(spec)


def _weights(uri: str | None) -> list[torch.Tensor]:
    return list(ckpt.read_state(Path(str(uri)))["models_state_dict"][0].values())


@pytest.mark.parametrize(("abandon", "reported"), [(False, [1]), (True, [])])
def test_the_loop_stops_on_the_control_and_an_abandoned_stop_reports_nothing(
    model_dir: Path, tmp_path: Path, abandon: bool, reported: list[int]
) -> None:
    held = _held(model_dir, tmp_path / "held")
    try:
        control = TrialControl()
        control.abandon() if abandon else control.request_stop()
        assert held.train_to(10, control) == 1
        assert [step for step, _ in held._controller.sink.training] == reported
        control.set_stop_requested(False)  # the runner's next step: its request is spent
        assert held.train_to(10, control) == 10
    finally:
        held.close()


def test_training_under_an_unset_control_equals_training_without_one(
    model_dir: Path, tmp_path: Path
) -> None:
    with_control, without = _held(model_dir, tmp_path / "a"), _held(model_dir, tmp_path / "b")
    try:
        assert with_control.train_to(12, TrialControl()) == 12
        assert without.train_to(12) == 12
        _, uri_a = with_control.checkpoint()
        _, uri_b = without.checkpoint()
    finally:
        with_control.close()
        without.close()
    for a, b in zip(_weights(uri_a), _weights(uri_b), strict=True):
        assert torch.equal(a, b)
