"""The no-server mode: ``python -m flows.experiment CONFIG`` with no MLflow, S3 or Prefect
configured runs on Prefect's ephemeral server and a local MLflow SQLite store, and what it
prints is the experiment, not Prefect's shutdown noise."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import env_without_platform, environment

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "tests" / "fixtures" / "flow_model" / "grid.yaml"
MODEL_DEF = GRID.parent / "model_def.py"

NOISE = (
    "Traceback",
    "CancelledError",
    "Still processing items",
    "Failed to send telemetry",
    "RuntimeWarning",  # runpy's, from every new worker re-running the preloaded main module
)


def _line_raising(text: str) -> int:
    """The fixture model's line that raises ``text`` (edits above it move it)."""
    lines = MODEL_DEF.read_text().splitlines()
    found = [n for n, line in enumerate(lines, 1) if f'raise ValueError(f"{text}' in line]
    assert len(found) == 1, f"{MODEL_DEF} should raise {text!r} on exactly one line: {found}"
    return found[0]


def _clean_env(home: Path) -> dict[str, str]:
    return env_without_platform(
        DET_TASKS_HOME=str(home / "det"), PREFECT_HOME=str(home / "prefect")
    )


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.experiment", *args],
        cwd=home,
        env={**_clean_env(home), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_embedded_grid_runs_without_servers(tmp_path: Path) -> None:
    """Also the first use of a fresh home by two experiments started together: both find no
    MLflow or Prefect database; one creates each schema, the other waits (before, "table
    ... already exists" or an alembic mismatch killed one of them)."""
    pytest.importorskip("mlflow")
    from det_tasks.pytorch import load_trial_from_checkpoint_path
    from registry.runs.tracking import client_for

    beside = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.experiment",
            str(GRID),
            "searcher.max_trials=1",
            "name=beside",
        ],
        cwd=tmp_path,
        env={**_clean_env(tmp_path), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc = _run([str(GRID)], tmp_path)
    _, beside_err = beside.communicate(timeout=600)
    assert beside.returncode == 0, beside_err[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in NOISE:
        assert noise not in proc.stderr, f"{noise!r} reached the terminal:\n{proc.stderr}"
    summary = json.loads(proc.stdout)
    # Both flow runs are in the home's Prefect database, and neither sent a heartbeat: the
    # server ended with its run, and the beat thread cost up to 1 s at every run's end.
    with contextlib.closing(sqlite3.connect(tmp_path / "prefect" / "prefect.db")) as db:
        events = dict(db.execute("select event, count(*) from events group by event"))
    assert events.get("prefect.flow-run.Completed") == 2
    assert "prefect.flow-run.heartbeat" not in events

    tracking_uri = f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}"
    client = client_for(tracking_uri)
    beside_experiment = client.get_experiment_by_name("beside")
    assert beside_experiment is not None
    beside_runs = client.search_runs([beside_experiment.experiment_id])
    assert len(beside_runs) == 2 and all(r.info.status == "FINISHED" for r in beside_runs)
    experiment = client.get_experiment_by_name("flow-grid")
    assert experiment is not None
    assert experiment.artifact_location.startswith((tmp_path / "det" / "artifacts").as_uri())
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(trials) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    final_losses = {
        int(r.data.tags["det.trial_id"]): r.data.metrics["validation/validation_loss"]
        for r in trials
    }
    best_trial = min(final_losses, key=final_losses.__getitem__)
    assert summary["best"]["trial_id"] == best_trial
    assert summary["best"]["metric"] == pytest.approx(final_losses[best_trial])
    # 4 trials x 40 batches, each trained exactly once: no duplicated metric points.
    for run in trials:
        history = client.get_metric_history(run.info.run_id, "validation/validation_loss")
        assert len({m.step for m in history}) == len(history)

    # The best checkpoint's bytes are in the local artifact directory and it loads back.
    with environment(MLFLOW_TRACKING_URI=tracking_uri):
        trial = load_trial_from_checkpoint_path(summary["best"]["checkpoint"])
    assert type(trial).__name__ == "XorTrial"
    uuid = summary["best"]["checkpoint"].rsplit("/", 1)[-1]
    stored = list((tmp_path / "det" / "artifacts").rglob(f"checkpoints/{uuid}/metadata.json"))
    assert len(stored) == 1


def test_embedded_bad_override_fails_before_any_server(tmp_path: Path) -> None:
    proc = _run([str(GRID), "searcher.max_length.batches=-3"], tmp_path)
    assert proc.returncode == 2
    assert "searcher.max_length.batches" in proc.stderr and "-3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Starting temporary server" not in proc.stderr
    assert not (tmp_path / "det" / "mlflow.db").exists()


def test_a_failing_trial_ends_failed_everywhere_with_one_last_line(tmp_path: Path) -> None:
    """train_batch raises at batch 3; max_restarts: 1 retries it once from batch 0."""
    pytest.importorskip("mlflow")
    from registry.runs.tracking import client_for

    proc = _run(
        [str(GRID), "searcher.max_trials=1", "data.fail_at_batch=3", "max_restarts=1"], tmp_path
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    raising = _line_raising("planted failure")
    line = (
        "trial 1 failed in train_batch at batch 3 after 2 attempts: "
        f"ValueError: planted failure at batch 3 (model_def.py:{raising})"
    )
    assert proc.stderr.splitlines()[-1] == f"error: {line}"
    # One traceback, the trial's own frames, printed once; no engine traceback.
    assert proc.stderr.count("Traceback") == 1
    assert f'model_def.py", line {raising}, in train_batch' in proc.stderr
    assert "site-packages" not in proc.stderr
    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-grid")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2
    for run in runs:
        assert run.info.status == "FAILED" and run.info.end_time is not None
        assert run.data.tags["det.error"] == line
        assert run.data.tags["det.state"] == "ERROR"


@pytest.mark.parametrize(
    ("entrypoint", "says"),
    [
        ("nope:XorTrial", "no module 'nope' in model directory"),
        ("model_def:XorData", "is not a PyTorchTrial subclass"),
    ],
)
def test_entrypoint_errors_fail_before_anything_starts(
    tmp_path: Path, entrypoint: str, says: str
) -> None:
    proc = _run([str(GRID), f"entrypoint={entrypoint}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]
    assert says in proc.stderr and proc.stderr.startswith("error: entrypoint")
    # Nothing was started: no MLflow store, no Prefect database in the home.
    assert not (tmp_path / "det" / "mlflow.db").exists()
    assert not (tmp_path / "prefect" / "prefect.db").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_embedded_workers_train_on_their_share_of_the_cores(workers: int) -> None:
    """Dask's Nanny gives each worker one thread; a lone worker gets every core. Asked on the
    thread steps run on (the executor's), through the flow's client."""
    from cluster.startup import CLIENT_SEND_INTERVAL_S, background_cluster, dask_client
    from det_tasks.cpu_threads import available_cores

    def torch_threads() -> int:
        import torch

        return torch.get_num_threads()

    with background_cluster(workers), dask_client(workers) as client:
        addresses = list(client.scheduler_info()["workers"])
        threads = [
            client.submit(torch_threads, workers=[a], pure=False).result() for a in addresses
        ]
        assert client.scheduler_comm.interval == CLIENT_SEND_INTERVAL_S
    assert threads == [max(available_cores() // workers, 1)] * workers
