"""Only an experiment run that stopped short may be activated
(registry.experiments.activation), asked of a real MLflow store (SQLite): PAUSED and
ORPHANED ones continue; a completed, cancelled or failed one, a running one and an unknown
key are refused in one line. (Before, ``--activate NOSUCHKEY`` started a new experiment and
``--activate`` of a completed one "continued" it with 0 trials, both exit 0.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_tasks.errors import DetTasksError
from registry.experiments.activation import (
    check_activatable,
    check_activation,
    experiment_run_state,
)
from registry.runs.run_states import (
    FLOW_PROCESS_TAG,
    ORPHAN_AFTER_S,
    end_orphans,
    end_running_runs,
    heartbeat,
    this_process,
)
from registry.runs.tracking import ExperimentRuns

NAME = "activation"


@pytest.fixture(autouse=True)
def artifact_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path / "artifacts"))


def _experiment_run(client: Any) -> tuple[ExperimentRuns, str]:
    key = str(uuid.uuid4())
    return ExperimentRuns(client, NAME, key, {"name": NAME}), key


def _check(client: Any, key: str, name: str = NAME, now: float | None = None) -> None:
    check_activatable(client, name, key, "the test store", now)


def test_a_paused_experiment_may_be_activated(mlflow_store: tuple[Any, Path]) -> None:
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    end_running_runs(client, runs.experiment_id, runs.parent_run_id, "PAUSED")
    _check(client, key)


@pytest.mark.parametrize(
    ("status", "state"), [("FINISHED", None), ("KILLED", "CANCELED"), ("FAILED", "ERROR")]
)
def test_an_experiment_that_ended_is_refused(
    mlflow_store: tuple[Any, Path], status: str, state: str | None
) -> None:
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    runs.finish(runs.parent_run_id, status, state)
    shown = state or "COMPLETED"
    with pytest.raises(DetTasksError) as refused:
        _check(client, key)
    assert str(refused.value) == (
        f"experiment {key[:8]} is {shown}, not paused: only a paused experiment can be "
        "activated (leave --activate out to start a new experiment)"
    )


def test_a_running_experiment_is_already_active(mlflow_store: tuple[Any, Path]) -> None:
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    heartbeat(client, runs.parent_run_id, now=time.time() - 5)  # this process beats
    with pytest.raises(DetTasksError, match=rf"experiment {key[:8]} is already active "):
        _check(client, key)


def test_a_flow_that_stopped_beating_may_be_activated(mlflow_store: tuple[Any, Path]) -> None:
    """Whether or not an experiment start swept it (ORPHANED) yet."""
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    heartbeat(client, runs.parent_run_id, now=time.time() - ORPHAN_AFTER_S - 5)
    parent = client.get_run(runs.parent_run_id)
    assert experiment_run_state(parent) == "ORPHANED"
    _check(client, key)
    end_orphans(client, [runs.experiment_id])
    assert client.get_run(runs.parent_run_id).data.tags["det.state"] == "ORPHANED"
    _check(client, key)


def test_a_sigkilled_flow_on_this_host_may_be_activated_at_once(
    mlflow_store: tuple[Any, Path],
) -> None:
    """Its heartbeat is fresh, but the process that beat is gone (a later process with
    the same pid would have another start time)."""
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    flow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = psutil.Process(flow.pid).create_time()
    os.kill(flow.pid, signal.SIGKILL)
    flow.wait()
    host = this_process().split(" ")[0]
    heartbeat(client, runs.parent_run_id)
    client.set_tag(runs.parent_run_id, FLOW_PROCESS_TAG, f"{host} {flow.pid} {started:.2f}")
    _check(client, key)
    reused = f"{host} {os.getpid()} {started:.2f}"  # a live pid, another process's start
    client.set_tag(runs.parent_run_id, FLOW_PROCESS_TAG, reused)
    _check(client, key)


def test_an_unknown_or_malformed_key_is_refused(mlflow_store: tuple[Any, Path]) -> None:
    client, _ = mlflow_store
    _experiment_run(client)
    unknown = str(uuid.uuid4())
    with pytest.raises(DetTasksError, match=f"--activate {unknown}: no experiment run has"):
        _check(client, unknown)
    with pytest.raises(DetTasksError, match="an experiment key is the UUID a paused run printed"):
        _check(client, "NOSUCHKEY")


def test_a_key_of_another_experiment_is_refused(mlflow_store: tuple[Any, Path]) -> None:
    client, _ = mlflow_store
    runs, key = _experiment_run(client)
    end_running_runs(client, runs.experiment_id, runs.parent_run_id, "PAUSED")
    with pytest.raises(DetTasksError, match=f"is in MLflow experiment '{NAME}', not 'other'"):
        _check(client, key, name="other")


def test_no_store_yet_is_refused_without_creating_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    key = str(uuid.uuid4())
    with pytest.raises(DetTasksError, match=r"no experiment run has this key: MLflow's store"):
        check_activation(NAME, key)
    assert not (tmp_path / "home" / "mlflow.db").exists()
