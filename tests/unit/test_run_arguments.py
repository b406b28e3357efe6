"""``det-tasks run``'s own arguments are refused up front, in one line, before a run exists
(issue 40: ``--device cuda`` without CUDA was a 25-line traceback and a FAILED MLflow run;
``--max-batches 0`` trained everything and ``-3`` was a traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from det_tasks.runner.cli import main

MODEL = Path(__file__).resolve().parent.parent / "fixtures" / "determined_model"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return Path(shutil.copytree(MODEL, tmp_path / "model"))


@pytest.mark.parametrize("value", ["0", "-3", "ten"])
def test_max_batches_must_be_a_positive_whole_number(model, capsys, value):
    with pytest.raises(SystemExit) as exited:
        main(["run", str(model / "const.yaml"), "--no-progress", "--max-batches", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("det-tasks run: error: argument --max-batches: "), err
    assert "positive number; give 1 or more" in last or "not a whole number" in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_before_any_run(model, capsys, monkeypatch, device):
    store = model.parent / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    code = main(["run", str(model / "const.yaml"), "--no-progress", "--device", device])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--device {device!r}: CUDA is not available on this machine" in err
    assert "use --device cpu" in err
    assert not store.exists()  # no MLflow run, not even its database


def test_a_device_torch_does_not_know_is_refused(model, capsys):
    code = main(["run", str(model / "const.yaml"), "--no-progress", "--device", "gpu"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "--device 'gpu' is not a torch device" in err
