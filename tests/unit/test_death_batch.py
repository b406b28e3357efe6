"""A trial whose Dask worker died is reported at the batch it had reached, as its MLflow
run last heard (``progress/batches``), not at the batch its step began (issue 50: a lost
host's trial at batch 300-500 read "failed in train at batch 0")."""

from __future__ import annotations

import socket
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from cluster.held_trials import StepRequest
from cluster.worker_deaths import explain_death
from det_tasks.runner.held import TrialSpec
from registry.runs.tracking import PARENT_TAG, TRIAL_TAG


def _request(experiment_id: str, parent: str, start: int = 0) -> StepRequest:
    spec = TrialSpec(config_path="c.yaml", model_dir=".", overrides=(), trial_id=1, hparams={})
    return StepRequest(spec, "train", start, 500, parent, experiment_id)


def _lost_host_error() -> Any:
    """Dask's KilledWorker as explain_death reads it: the worker's Nanny gone with its host
    (a closed port: not waited for)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    worker = types.SimpleNamespace(name="worker-3", nanny=f"tcp://127.0.0.1:{port}")
    return types.SimpleNamespace(last_worker=worker)


def test_a_dead_workers_trial_is_reported_at_the_batch_it_reached(
    mlflow_store: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, root = mlflow_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.create_experiment(f"death-batch-{uuid.uuid4().hex[:8]}")
    parent = client.create_run(experiment).info.run_id
    trial = client.create_run(experiment, tags={TRIAL_TAG: "1", PARENT_TAG: parent})
    client.log_metric(trial.info.run_id, "progress/batches", 400, step=400)
    failure = explain_death(None, _lost_host_error(), _request(experiment, parent))  # type: ignore[arg-type]
    assert str(failure).startswith(
        "trial 1 failed in train at batch 400: its Dask worker worker-3 died while training "
        "from batch 0: its process ended (exit code unknown"
    )
    # Nothing reported yet for another trial's experiment: where its step began.
    other = client.create_experiment(f"death-batch-{uuid.uuid4().hex[:8]}")
    failure = explain_death(None, _lost_host_error(), _request(other, "none", start=200))  # type: ignore[arg-type]
    assert failure.batch == 200
