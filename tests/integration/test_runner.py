"""`det-tasks run` end to end: the MNIST example's accuracy target, test mode, both
entrypoint forms, and a Determined trial file run unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from det_tasks.runner import run_trial

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def test_mnist_const_reaches_95_percent(tmp_path):
    result = run_trial(ROOT / "examples/mnist/const.yaml", checkpoint_dir=tmp_path, progress=False)
    assert result.validation_metrics is not None
    assert result.validation_metrics["accuracy"] >= 0.95
    # Retention (save_trial_latest: 1, save_trial_best: 1): only kept checkpoints remain.
    kept = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert 1 <= len(kept) <= 2 and result.checkpoint_uuid in {p.name for p in kept}


def test_test_mode_trains_and_validates_one_batch(tmp_path):
    result = run_trial(
        ROOT / "examples/mnist/const.yaml", checkpoint_dir=tmp_path, test_mode=True, progress=False
    )
    assert result.batches_trained == 1
    assert [s for s, _ in result.sink.validation] == [1]
    assert (tmp_path / str(result.checkpoint_uuid) / "state_dict.pth").exists()


def test_trainer_api_script_entrypoint(tmp_path):
    result = run_trial(FIXTURES / "trainer_api/const.yaml", checkpoint_dir=tmp_path, progress=False)
    # 64 records / 16 = 4 batches per epoch, 10 epochs, SGD lr 0.01 on (1, 1):
    # 1 - w_n = (1 - w_0) * 0.98^n, with w_0 the seeded (experiment_seed 0) initial weight.
    torch.manual_seed(0)
    w0 = torch.nn.Linear(1, 1, bias=False).weight.item()
    assert result.batches_trained == 40
    state = torch.load(tmp_path / str(result.checkpoint_uuid) / "state_dict.pth", weights_only=True)
    weight = state["models_state_dict"][0]["weight"].item()
    assert weight == pytest.approx(1 - (1 - w0) * 0.98**40, abs=1e-5)
    # min_validation_period=Epochs(1): one validation per epoch.
    assert [s for s, _ in result.sink.validation] == [4 * e for e in range(1, 11)]


def test_determined_trial_file_runs_unchanged_through_the_cli(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(FIXTURES / "determined_model/const.yaml"),
            "--checkpoint-dir",
            str(tmp_path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["batches_trained"] == 200
    assert summary["validation"]["accuracy"] == 1.0
    assert summary["hparams"] == {"global_batch_size": 8, "hidden_size": 8, "learning_rate": 0.05}


def test_cli_resume_continues_to_max_length(tmp_path):
    first = run_trial(
        FIXTURES / "determined_model/const.yaml",
        checkpoint_dir=tmp_path,
        overrides=["searcher.max_length.batches=60"],
        progress=False,
    )
    resumed = run_trial(
        FIXTURES / "determined_model/const.yaml",
        checkpoint_dir=tmp_path,
        latest_checkpoint=first.checkpoint_uuid,
        progress=False,
    )
    assert first.batches_trained == 60 and resumed.batches_trained == 200
    assert next(s for s, _ in resumed.sink.training) > 60
