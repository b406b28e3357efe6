"""Issue 52 item 5 on the real stack: a plain script using ``core_v2.init()`` (unmanaged
mode), started by hand with the stack's environment, reports a counter to MLflow, stores
a checkpoint in S3, is listed by ``det experiment list`` like a submitted experiment, and
ends COMPLETED; one that raises ends ERROR."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from det_tasks.checkpoints.references import open_checkpoint_uri
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "core_v2" / "unmanaged.py"
RECORD_KEYS = {"uuid", "uri", "s3_uri", "steps_completed", "validation_metrics", "bytes"}


def _run_script(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "det_tasks.runner.script", str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _runs(client, name: str) -> tuple[object, object]:
    """(parent run, trial run) of the unmanaged experiment ``name``."""
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, name
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(trials) == 1, [r.info.run_name for r in runs]
    return parents[0], trials[0]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def _det(*args: str) -> subprocess.CompletedProcess[str]:
    det = str(Path(sys.executable).parent / "det")
    return subprocess.run([det, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _listing() -> str:
    listed = _det("experiment", "list")
    assert listed.returncode == 0, listed.stderr
    return listed.stdout


def test_unmanaged_script_reports_to_mlflow_and_s3_and_is_listed(stack, tmp_path):
    name = f"unmanaged-{uuid.uuid4().hex[:6]}"
    done = _run_script("--name", name, "--increment-by", "3", "--batches", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    parent, trial = _runs(client, name)
    run_id = trial.info.run_id
    assert _history(client, run_id, "training/x") == [(10, 30.0), (20, 60.0), (30, 90.0)]
    assert _history(client, run_id, "validation/x") == [(30, 90.0)]
    assert trial.data.params["hp.increment_by"] == "3"
    records = checkpoint_records(client, run_id)
    assert [r["steps_completed"] for r in records] == [30]
    assert set(records[0]) == RECORD_KEYS
    assert records[0]["uri"] == f"runs:/{run_id}/checkpoints/{records[0]['uuid']}"
    assert records[0]["s3_uri"].startswith("s3://") and records[0]["bytes"] > 0
    with open_checkpoint_uri(records[0]["uri"]) as path:  # fetched from S3
        assert (path / "state").read_text() == "90,30"
    for run in (client.get_run(parent.info.run_id), client.get_run(run_id)):
        assert (run.info.status, run.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    assert trial.data.tags["det.trial_id"] == "1"
    listed = [line for line in _listing().splitlines() if name in line]
    assert len(listed) == 1 and "COMPLETED" in listed[0] and " 1 " in listed[0], listed
    described = _det("experiment", "describe", listed[0].split()[0])
    assert described.returncode == 0, described.stderr
    assert name in described.stdout and "COMPLETED" in described.stdout


def test_unmanaged_script_that_raises_ends_error(stack):
    name = f"unmanaged-fail-{uuid.uuid4().hex[:6]}"
    done = _run_script("--name", name, "--batches", "30", "--fail-at", "25")
    assert done.returncode != 0 and "failing on purpose at batch 25" in done.stderr
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    parent, trial = _runs(client, name)
    assert _history(client, trial.info.run_id, "training/x") == [(10, 10.0), (20, 20.0)]
    for run in (client.get_run(parent.info.run_id), client.get_run(trial.info.run_id)):
        assert (run.info.status, run.data.tags["det.state"]) == ("FAILED", "ERROR")
    listed = [line for line in _listing().splitlines() if name in line]
    assert len(listed) == 1 and "ERROR" in listed[0], listed


def test_a_script_with_the_same_external_ids_rejoins_the_trial_and_continues(stack):
    name = f"unmanaged-rejoin-{uuid.uuid4().hex[:6]}"
    ids = ["--external-experiment-id", name, "--external-trial-id", "t1", "--increment-by", "3"]
    for batches in ("30", "50"):
        done = _run_script("--name", name, *ids, "--batches", batches)
        assert done.returncode == 0, done.stderr[-3000:]
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    parent, trial = _runs(client, name)  # still one experiment run of one trial
    run_id = trial.info.run_id
    expected = [(n, 3.0 * n) for n in (10, 20, 30, 40, 50)]  # continued from x=90 at 30
    assert _history(client, run_id, "training/x") == expected
    # Determined's default GC (keep the trial's best and latest) removed batch 30's at the end.
    assert [r["steps_completed"] for r in checkpoint_records(client, run_id)] == [50]
    for run in (client.get_run(parent.info.run_id), client.get_run(run_id)):
        assert (run.info.status, run.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    listed = [line for line in _listing().splitlines() if name in line]
    assert len(listed) == 1 and "COMPLETED" in listed[0], listed
