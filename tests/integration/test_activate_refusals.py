"""``python -m flows.experiment CONFIG --activate KEY`` continues only an experiment that
stopped short. An unknown key used to start a new experiment, and a completed one was
"activated" with 0 trials to start, both exiting 0; now each is one line, exit 2, and
nothing starts (no Prefect server, no MLflow run)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.helpers import FLOW_MODEL, environment, home_env

GRID = FLOW_MODEL / "grid.yaml"  # name: flow-grid


def _activate(home: Path, key: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(GRID), "--activate", key],
        cwd=home,
        env=home_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def home_with_a_completed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A home whose MLflow store holds one completed experiment run of flow-grid, and its
    key."""
    from registry.runs.tracking import ExperimentRuns, client_for

    home = tmp_path_factory.mktemp("activate")
    (home / "det").mkdir()
    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    key = str(uuid.uuid4())
    with environment(DET_TASKS_ARTIFACT_ROOT=str(home / "det" / "artifacts")):
        runs = ExperimentRuns(client, "flow-grid", key, {"name": "flow-grid"})
        runs.finish(runs.parent_run_id)
    return home, key


def _run_count(home: Path) -> int:
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))


def test_activating_a_completed_experiment_is_refused(
    home_with_a_completed_run: tuple[Path, str],
) -> None:
    home, completed_key = home_with_a_completed_run
    done = _activate(home, completed_key)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: experiment {completed_key[:8]} is COMPLETED, not paused: only a paused "
        "experiment can be activated (leave --activate out to start a new experiment)"
    ]
    assert done.stdout == ""
    assert _run_count(home) == 1
    assert not (home / "prefect" / "prefect.db").exists()


@pytest.mark.parametrize("kind", ["malformed", "unknown"])
def test_activating_an_unknown_key_starts_nothing(
    home_with_a_completed_run: tuple[Path, str], kind: str
) -> None:
    home, _ = home_with_a_completed_run
    key = "NOSUCHKEY" if kind == "malformed" else str(uuid.uuid4())
    done = _activate(home, key)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    expected = "UUID a paused run printed" if kind == "malformed" else "no experiment run has"
    assert line.startswith(f"error: --activate {key!r}:" if kind == "malformed" else "error:")
    assert expected in line and "leave --activate out to start a new experiment" in line
    assert _run_count(home) == 1  # only the completed one: no new experiment run
    assert not (home / "prefect" / "prefect.db").exists()


def test_activating_in_a_fresh_home_creates_no_store(tmp_path: Path) -> None:
    done = _activate(tmp_path, str(uuid.uuid4()))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "MLflow's store" in done.stderr and "does not exist" in done.stderr
    assert not (tmp_path / "det" / "mlflow.db").exists()
    assert not (tmp_path / "prefect" / "prefect.db").exists()
