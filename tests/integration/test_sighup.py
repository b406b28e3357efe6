"""SIGHUP (a closed terminal, a dropped ssh session) is a stop like SIGTERM.

- ``python -m flows.experiment``: SIGHUP to its main process, or to its whole process group
  (what a closing terminal sends to its foreground job: Dask workers included), pauses with a
  checkpoint at the stop batch, prints the ``--activate`` line and leaves no run RUNNING; the
  line continues the same runs to weights bit-equal to an undisturbed run. Under ``nohup``
  (SIGHUP ignored) the experiment finishes as if nothing was sent.
- ``det-tasks run``: SIGHUP and SIGTERM stop at the next batch boundary with a checkpoint,
  print the ``--resume`` command and exit 128 + the signal's number; that command trains on
  to weights bit-equal to an undisturbed run."""

from __future__ import annotations

import functools
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import (
    FLOW_MODEL,
    REPO,
    environment,
    group_alive,
    home_env,
    killable_runs,
    newest_weights,
    paused_at_the_stop_batch,
    signal_midway,
    undisturbed_weights,
)

CONFIG = FLOW_MODEL / "killable.yaml"  # one trial, 120 batches, checkpoints every 30
SLOW_BATCHES = "hyperparameters.sleep_s=0.1"  # 12 s of training: time to stop it midway
NO_SLEEP = "hyperparameters.sleep_s=0"  # the undisturbed reference: the same weights, sooner


def _sighup_at(disposition: signal.Handlers) -> Callable[[], object]:
    """A ``preexec_fn`` setting the child's SIGHUP: SIG_IGN is what nohup does before it
    execs the command; SIG_DFL is a terminal's job, whatever this test run inherited (CI
    started under ``nohup`` ignores it in every process it starts)."""
    return functools.partial(signal.signal, signal.SIGHUP, disposition)


def _experiment(home: Path, *args: str, ignore_hup: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), SLOW_BATCHES, *args],
        cwd=home,
        env=home_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=_sighup_at(signal.SIG_IGN if ignore_hup else signal.SIG_DFL),
    )


def _assert_equal_weights(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(want) == list(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("group", [False, True], ids=["process", "group"])
def test_sighup_pauses_the_flow_with_a_checkpoint_and_activate_continues_bit_equal(
    tmp_path: Path, group: bool
) -> None:
    pytest.importorskip("mlflow")
    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records

    pid_file = tmp_path / "pids"
    proc = _experiment(tmp_path, f"data.pid_file={pid_file}")
    stderr, _ = signal_midway(proc, pid_file, 4, signal.SIGHUP, group)
    assert proc.returncode == 130, stderr[-3000:]
    time.sleep(1)
    assert group_alive(proc.pid) == []
    match = re.search(r"--activate ([0-9a-f-]{36})", stderr)
    assert match, stderr[-2000:]
    runs, trial, client = paused_at_the_stop_batch(tmp_path)  # none RUNNING

    resumed = _experiment(tmp_path, "--activate", match.group(1))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    runs_after = killable_runs(tmp_path)
    assert sorted(r.info.run_id for r in runs_after) == sorted(r.info.run_id for r in runs)
    assert {r.info.status for r in runs_after} == {"FINISHED"}
    records = checkpoint_records(client, trial.info.run_id)
    assert records[-1]["steps_completed"] == 120
    with environment(
        replace=home_env(tmp_path),
        MLFLOW_TRACKING_URI=f"sqlite:///{(tmp_path / 'det' / 'mlflow.db')}",
    ):
        got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
    _assert_equal_weights(undisturbed_weights(tmp_path, NO_SLEEP), dict(got.model.state_dict()))


def test_sighup_under_nohup_is_ignored_and_the_experiment_finishes(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pid_file = tmp_path / "pids"
    proc = _experiment(tmp_path, f"data.pid_file={pid_file}", ignore_hup=True)
    stderr, _ = signal_midway(proc, pid_file, 4, signal.SIGHUP)
    assert proc.returncode == 0, stderr[-3000:]
    assert "--activate" not in stderr
    runs = killable_runs(tmp_path)
    assert {r.info.status for r in runs} == {"FINISHED"}
    trial = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    assert int(trial.data.metrics["progress/batches"]) == 120


def _det_tasks_command(*args: str) -> list[str]:
    command = [sys.executable, "-m", "det_tasks.runner.cli", "run", str(CONFIG), str(FLOW_MODEL)]
    return [*command, "--no-progress", "--param", SLOW_BATCHES, *args]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_det_tasks_run_checkpoints_on_sighup_and_sigterm_and_resume_trains_on(
    tmp_path: Path, signum: int
) -> None:
    from det_tasks.checkpoints import format as checkpoint_format

    checkpoints = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        _det_tasks_command("--checkpoint-dir", str(checkpoints)),
        cwd=tmp_path,
        env=home_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sighup_at(signal.SIG_DFL),
    )
    time.sleep(1)
    while proc.poll() is None and not list(checkpoints.glob("*/metadata.json")):
        time.sleep(0.2)  # past the first periodic checkpoint (batch 30)
    time.sleep(1)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    found = re.fullmatch(
        rf"stopped by {name} at batch (\d+), checkpoint (\S+); continue with: (.*)", last
    )
    assert found, last
    batch, reference, command = int(found.group(1)), found.group(2), found.group(3)
    assert 30 < batch < 120
    assert checkpoint_format.verify(Path(reference))["steps_completed"] == batch

    argv = shlex.split(command)
    assert argv[:2] == ["det-tasks", "run"] and argv[-2:] == ["--resume", reference]
    resumed = subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *argv[1:]],
        cwd=tmp_path,
        env={**home_env(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    newest = max(checkpoints.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    assert checkpoint_format.verify(newest.parent)["steps_completed"] == 120
    want = undisturbed_weights(tmp_path, NO_SLEEP)
    _assert_equal_weights(want, newest_weights(tmp_path, checkpoints))
