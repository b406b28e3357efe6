"""Stopping and continuing an experiment as a user does: Ctrl-C on ``python -m
flows.experiment`` (SIGINT to the terminal's whole process group) checkpoints every trial
at its stop batch, ends every run KILLED with det.state PAUSED and leaves no process; the
printed ``--activate KEY`` continues the same runs to weights bit-equal to a run that never
stopped."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import (
    ctrl_c_midway,
    environment,
    group_alive,
    home_env,
    killable_runs,
    paused_at_the_stop_batch,
)

REPO = Path(__file__).resolve().parents[2]
FLOW_MODEL = REPO / "tests" / "fixtures" / "flow_model"
CONFIG = FLOW_MODEL / "killable.yaml"  # one trial, 120 batches, checkpoints every 30
SLOW_BATCHES = "hyperparameters.sleep_s=0.1"  # 12 s of training: time to stop it midway


def _experiment(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), SLOW_BATCHES, *args],
        cwd=home,
        env=home_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def test_ctrl_c_checkpoints_at_the_stop_batch_and_activate_continues_bit_equal(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records

    pid_file = tmp_path / "pids"
    proc = _experiment(tmp_path, f"data.pid_file={pid_file}")
    # some batches in, between two periodic checkpoints or past one
    stderr, took = ctrl_c_midway(proc, pid_file, after_s=4)
    assert proc.returncode == 130, stderr[-3000:]
    assert took <= 30, f"exit took {took:.1f} s"
    time.sleep(1)
    assert group_alive(proc.pid) == []

    match = re.search(r"--activate ([0-9a-f-]{36})", stderr)
    assert match, stderr[-2000:]
    key = match.group(1)
    runs, trial, client = paused_at_the_stop_batch(tmp_path)

    resumed = _experiment(tmp_path, "--activate", key)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    runs_after = killable_runs(tmp_path)
    assert sorted(r.info.run_id for r in runs_after) == sorted(r.info.run_id for r in runs)
    assert {r.info.status for r in runs_after} == {"FINISHED"}
    records = checkpoint_records(client, trial.info.run_id)
    assert records[-1]["steps_completed"] == 120

    # The same trial, never stopped, in one process: bit-equal final weights.
    reference_dir = tmp_path / "reference"
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(CONFIG),
            str(FLOW_MODEL),
            "--no-progress",
            "--checkpoint-dir",
            str(reference_dir),
        ],
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    newest = max(reference_dir.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    with environment(
        replace=home_env(tmp_path),
        MLFLOW_TRACKING_URI=f"sqlite:///{(tmp_path / 'det' / 'mlflow.db')}",
    ):
        got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
    want = pytorch.load_trial_from_checkpoint_path(str(newest.parent), trial_class=type(got))
    for a, b in zip(want.model.state_dict().values(), got.model.state_dict().values()):
        assert torch.equal(a, b)
