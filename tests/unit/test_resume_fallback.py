"""A corrupted newest checkpoint: the loader refuses it naming the file and the checksum,
and a resume given the trial's checkpoints (newest first) falls back to the previous good
one and still ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from det_tasks import CheckpointError
from det_tasks.runner.in_process import run_trial

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"
CONFIG = FLOW_MODEL / "killable.yaml"
OVERRIDES = ["hyperparameters.sleep_s=0"]


@pytest.fixture(autouse=True)
def _no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _checkpoints_by_step(root: Path) -> dict[int, str]:
    found = {}
    for meta in root.glob("*/metadata.json"):
        found[json.loads(meta.read_text())["steps_completed"]] = meta.parent.name
    return found


def _weights(checkpoint: Path) -> list[torch.Tensor]:
    state = torch.load(checkpoint / "state_dict.pth", weights_only=True)
    return list(state["models_state_dict"][0].values())


def _train(root: Path, batches: int, resume: list[str] | None = None):  # type: ignore[no-untyped-def]
    return run_trial(
        CONFIG,
        FLOW_MODEL,
        overrides=OVERRIDES,
        checkpoint_dir=root,
        progress=False,
        max_batches=batches,
        latest_checkpoint=resume,
    )


def test_resume_falls_back_past_a_corrupted_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = _train(tmp_path / "full", 90)
    _train(tmp_path / "cut", 60)
    steps = _checkpoints_by_step(tmp_path / "cut")
    assert sorted(steps) == [30, 60]
    state = tmp_path / "cut" / steps[60] / "state_dict.pth"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))

    resumed = _train(tmp_path / "cut", 90, resume=[steps[60], steps[30]])

    err = capsys.readouterr().err
    assert f"checkpoint {steps[60]} is unusable" in err
    assert "state_dict.pth" in err and "sha256" in err
    assert resumed.batches_trained == 90
    assert resumed.checkpoint_uri is not None and full.checkpoint_uri is not None
    for a, b in zip(
        _weights(Path(full.checkpoint_uri)), _weights(Path(resumed.checkpoint_uri)), strict=True
    ):
        assert torch.equal(a, b)


def test_no_intact_checkpoint_is_an_error_listing_each(tmp_path: Path) -> None:
    _train(tmp_path, 60)
    steps = _checkpoints_by_step(tmp_path)
    for uuid in steps.values():
        with open(tmp_path / uuid / "state_dict.pth", "r+b") as f:
            f.truncate(100)
    with pytest.raises(CheckpointError, match="no intact checkpoint") as err:
        _train(tmp_path, 90, resume=[steps[60], steps[30]])
    assert str(err.value).count("truncated") == 2


def test_a_single_named_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    _train(tmp_path, 30)
    (uuid,) = _checkpoints_by_step(tmp_path).values()
    (tmp_path / uuid / "load_data.json").write_text('{"tampered": true}')
    with pytest.raises(CheckpointError, match=r"load_data\.json.*(corrupted|truncated)"):
        _train(tmp_path, 60, resume=[uuid])
