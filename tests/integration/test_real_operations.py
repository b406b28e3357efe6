"""Real trials under real operations, without servers (``python -m flows.experiment`` in a
home of its own, its own process group as a terminal's job): DataLoader worker processes in
a flow under SIGTERM to the whole process group (what ``timeout``, ``kill -- -PGID``, systemd and
Kubernetes send), a trial stuck in ``train_batch`` stopped at the default grace, and a trial
that ends its own worker process, explained in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import (
    group_alive,
    home_env,
    killable_runs,
    paused_at_the_stop_batch,
)

REPO = Path(__file__).resolve().parents[2]
FLOW_MODEL = REPO / "tests" / "fixtures" / "flow_model"
CONFIG = FLOW_MODEL / "killable.yaml"  # one trial, 120 batches, checkpoints every 30


def _experiment(home: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), *overrides],
        cwd=home,
        env=home_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, float]:
    started = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as late:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"still running after {timeout_s} s:\n{late.stderr!r:.6000}") from None
    return stderr, time.monotonic() - started


def _wait_for(pid_file: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()[1][-3000:]


def _alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_sigterm_to_the_process_group_pauses_with_a_checkpoint_and_exits(tmp_path: Path) -> None:
    """SIGTERM reaches every process of the group (Dask workers, their DataLoader workers,
    Prefect's server): it must do what SIGTERM to the main process does, a pause with a
    checkpoint at the stop batch. The trial loads its data with worker processes, as most
    real trials do: Dask's workers are daemonic by default, which refuses them ("daemonic
    processes are not allowed to have children")."""
    pytest.importorskip("mlflow")

    pid_file = tmp_path / "pids"
    proc = _experiment(
        tmp_path,
        "hyperparameters.sleep_s=0.1",
        "data.loader_workers=2",
        f"data.pid_file={pid_file}",
    )
    _wait_for(pid_file, proc)
    time.sleep(4)
    os.killpg(proc.pid, signal.SIGTERM)
    stderr, took = _finish(proc, 120)
    assert proc.returncode == 130, stderr[-3000:]
    assert took <= 30, f"exit took {took:.1f} s"
    assert "KilledWorker" not in stderr
    assert re.search(r"--activate [0-9a-f-]{36}", stderr), stderr[-2000:]
    time.sleep(1)
    assert group_alive(proc.pid) == []
    paused_at_the_stop_batch(tmp_path)


@pytest.mark.slow
def test_a_trial_stuck_in_train_batch_is_killed_at_the_default_grace(tmp_path: Path) -> None:
    """One Ctrl-C: the first message says how long a trial has and that a second Ctrl-C
    stops at once; the stuck trial's worker (and its DataLoader workers) is killed after the
    default 60 s, its run ends KILLED, and the command exits with nothing left behind."""
    pytest.importorskip("mlflow")
    import psutil

    pid_file = tmp_path / "pids"
    proc = _experiment(
        tmp_path,
        "hyperparameters.sleep_s=0",
        "data.stuck_at_batch=5",
        "data.loader_workers=2",
        f"data.pid_file={pid_file}",
    )
    _wait_for(pid_file, proc)
    worker = int(pid_file.read_text().split()[0])
    time.sleep(3)  # stuck at batch 5 by now
    loaders = [c.pid for c in psutil.Process(worker).children(recursive=True)]
    assert loaders, "the trial's DataLoader workers should be running"
    os.killpg(proc.pid, signal.SIGINT)
    stderr, took = _finish(proc, 180)
    assert proc.returncode == 130, stderr[-3000:]
    assert "within 60 s is killed (DET_TASKS_STOP_GRACE_S)" in stderr, stderr[-3000:]
    assert "a second Ctrl-C stops at once" in stderr
    assert "trial 1 did not reach a batch boundary within 60 s of the pause request" in stderr
    assert 60 <= took <= 100, f"exit took {took:.1f} s"
    time.sleep(1)
    assert group_alive(proc.pid) == []
    assert _alive([worker, *loaders]) == []
    runs = killable_runs(tmp_path)
    assert {r.info.status for r in runs} == {"KILLED"}


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("os_exit", "died while training from batch 0: exited with code 3"),
        ("sys_exit", "failed in train_batch at batch 3: SystemExit: 3"),
    ],
)
def test_a_trial_that_ends_its_own_process_is_explained(
    tmp_path: Path, how: str, says: str
) -> None:
    """``os._exit(3)`` kills the worker: the last line names the trial, the phase, the
    batches, the exit code and a likely cause, not Dask's KilledWorker. ``sys.exit(3)`` is
    the trial's failure, not the worker's end."""
    pytest.importorskip("mlflow")
    proc = _experiment(
        tmp_path,
        "hyperparameters.sleep_s=0",
        "data.exit_at_batch=3",
        f"data.exit_how={how}",
        "max_restarts=0",
    )
    stderr, _ = _finish(proc, 300)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: trial 1 failed in "), last
    assert says in last, last
    assert "KilledWorker" not in stderr
    runs = killable_runs(tmp_path)
    assert {r.info.status for r in runs} == {"FAILED"}
