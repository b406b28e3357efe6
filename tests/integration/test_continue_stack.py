"""``det experiment continue`` on the real stack, and a stack stopped under a running
experiment: the same flow run, MLflow runs and trial go on from the newest checkpoint,
bit-equal to one run of the full length; ``make down`` + ``make up`` under a running
experiment whose flow died with it (a reboot) leaves it ERROR (not ACTIVE) in ``det
experiment list``, its Prefect flow run final and its MLflow runs ORPHANED, after the first
``det`` command that looks, and ``describe`` prints how to continue it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from infra.stack import deploy, down, up
from registry.runs.run_states import ORPHAN_AFTER_S
from registry.runs.tracking import client_for
from tests.integration.helpers import env_without_platform, wait_for

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"
DET = str(Path(sys.executable).with_name("det"))


@pytest.fixture(scope="module")
def deployed(stack):
    deploy(stack)
    return stack


def _det(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DET, *args], capture_output=True, text=True, timeout=timeout)


def _create(name: str, *config: str) -> str:
    created = _det("experiment", "create", "killable.yaml", ".", "--config", f"name={name}",
                   *[arg for item in config for arg in ("--config", item)])  # fmt: skip
    assert created.returncode == 0, created.stderr[-3000:]
    found = re.search(r"Created experiment (\w+)", created.stdout)
    assert found, created.stdout
    return found.group(1)


def _flow_process(flow_run_id: str) -> Any:
    """The process Prefect's worker runs flow run ``flow_run_id`` in (psutil.Process)."""

    def find() -> Any:
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                    return proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return None

    return wait_for(find, 60, f"the process of flow run {flow_run_id}")


def _trial(client: Any, name: str) -> Any:
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    return runs, next(r for r in runs if "mlflow.parentRunId" in r.data.tags)


def _reference_weights(tmp_path: Path, batches: int, trial_class: type) -> dict[str, Any]:
    from det_tasks.pytorch import load_trial_from_checkpoint_path

    folder = tmp_path / "reference"
    done = subprocess.run(
        [str(Path(sys.executable).with_name("det-tasks")), "run", "killable.yaml", ".",
         "-p", "hyperparameters.sleep_s=0", "-p", f"searcher.max_length.batches={batches}",
         "--checkpoint-dir", str(folder), "--no-progress"],
        env=env_without_platform(DET_TASKS_HOME=str(tmp_path / "home")),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    newest = max(folder.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    loaded = load_trial_from_checkpoint_path(str(newest.parent), trial_class=trial_class)
    return dict(loaded.model.state_dict())


def test_continue_a_completed_experiment_on_the_stack_to_a_larger_length(
    deployed, tmp_path, monkeypatch
):
    from det_cli.ids import experiment_run
    from det_tasks.pytorch import load_trial_from_checkpoint_path
    from registry.checkpoints.store import checkpoint_records

    workdir = tmp_path / "xor"
    shutil.copytree(FLOW_MODEL, workdir)
    monkeypatch.chdir(workdir)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = _create(
        "continue-stack", "hyperparameters.sleep_s=0", "searcher.max_length.batches=60"
    )
    assert _det("experiment", "wait", exp_id, "--polling-interval", "1").returncode == 0
    runs, trial = _trial(client, "continue-stack")

    same = _det("experiment", "continue", exp_id)
    assert same.returncode == 0 and "nothing more to train" in same.stdout, same.stderr
    described = _det("experiment", "describe", exp_id)
    assert f"continue it with: det experiment continue {exp_id} --config" in described.stdout

    grown = _det("experiment", "continue", exp_id, "--config", "searcher.max_length.batches=120")
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "continues from its newest checkpoint, batch 60 to 120 batches" in grown.stdout
    assert _det("experiment", "wait", exp_id, "--polling-interval", "1").returncode == 0
    runs_after, _ = _trial(client, "continue-stack")
    assert sorted(r.info.run_id for r in runs_after) == sorted(r.info.run_id for r in runs)
    assert {(r.info.status, r.data.tags["det.state"]) for r in runs_after} == {
        ("FINISHED", "COMPLETED")
    }
    records = checkpoint_records(client, trial.info.run_id)
    assert [r["steps_completed"] for r in records] == [30, 60, 90, 120]  # each once
    steps = [m.step for m in client.get_metric_history(trial.info.run_id, "progress/batches")]
    assert len(steps) == len(set(steps)) and max(steps) == 120  # batches 1-60 not trained again
    assert str(experiment_run(exp_id).id).startswith(exp_id)  # the same experiment id
    continued = load_trial_from_checkpoint_path(records[-1]["uri"])
    got = dict(continued.model.state_dict())
    want = _reference_weights(tmp_path, 120, type(continued))
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_stack_stopped_under_a_running_experiment_is_settled_and_continues(
    deployed, tmp_path, monkeypatch
):
    from det_cli.ids import experiment_run
    from registry.checkpoints.store import checkpoint_records

    workdir = tmp_path / "xor"
    shutil.copytree(FLOW_MODEL, workdir)
    monkeypatch.chdir(workdir)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = _create("stack-down", "hyperparameters.sleep_s=0.1", "searcher.max_length.batches=300")

    def checkpointed() -> int:
        try:
            _, trial = _trial(client, "stack-down")
        except (AssertionError, StopIteration):
            return 0
        return max(
            (r["steps_completed"] for r in checkpoint_records(client, trial.info.run_id)), default=0
        )

    wait_for(checkpointed, 300, "a checkpoint of the running experiment")
    flow = _flow_process(str(experiment_run(exp_id).id))
    # `make down` alone no longer ends it: its flow runs in a session of its own under
    # Prefect's worker, waits for the services and trains on (test_chaos.py's stack fault,
    # bench/fault_recovery.py). A reboot takes the flow too: so does this test.
    try:
        down(deployed)  # make down
        with contextlib.suppress(psutil.NoSuchProcess):  # it may have ended with them
            flow.kill()
            flow.wait(timeout=30)
    finally:
        up(deployed)  # make up; the session's stack is every later test's too

    def row() -> str:
        listed = _det("experiment", "list")
        assert listed.returncode == 0, listed.stderr[-2000:]
        return next(line for line in listed.stdout.splitlines() if line.startswith(exp_id))

    # A holder is known dead once its heartbeat is ORPHAN_AFTER_S old (it may be on
    # another host): until then the experiment may still read ACTIVE, never after.
    settled = wait_for(lambda: "ERROR" in row(), ORPHAN_AFTER_S + 120, "ERROR in det list")
    assert settled and "ACTIVE" not in row()
    assert experiment_run(exp_id).state == "CRASHED"
    runs, trial = _trial(client, "stack-down")
    assert {r.info.status for r in runs} <= {"KILLED", "FAILED", "FINISHED"}
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.tags["det.state"] == "ORPHANED"
    described = _det("experiment", "describe", exp_id)
    assert re.search(
        rf"stopped at batch \d+ without finishing; continue it with: "
        rf"det experiment activate {exp_id}",
        described.stdout,
    ), described.stdout

    newest = checkpointed()
    resumed = _det("experiment", "continue", exp_id, "--config", "hyperparameters.sleep_s=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(ORPHANED) continues from its newest checkpoint, batch {newest}" in resumed.stdout
    assert (
        _det("experiment", "wait", exp_id, "--polling-interval", "1", timeout=600).returncode == 0
    )
    assert checkpoint_records(client, trial.info.run_id)[-1]["steps_completed"] == 300
