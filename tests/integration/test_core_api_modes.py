"""Issue 52 item 2 on the real stack: a Core API script (``entrypoint: python3
2_checkpoints.py``, no ``searcher.max_length``, as Determined 0.38 configs often have none)
submitted through ``det experiment create`` and through a Prefect deployment run reaches
MLflow as a PyTorchTrial does (``det.state``, ``progress/batches``, checkpoint records with
``runs:/`` and S3 URIs), and ``det checkpoint download`` fetches its checkpoint. The
counter's value is closed-form: ``x = batch * increment_by``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.stack import deploy
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "core_api"
DET = str(Path(sys.executable).with_name("det"))
RECORD_KEYS = {"uuid", "uri", "s3_uri", "steps_completed", "validation_metrics", "bytes"}


@pytest.fixture(scope="module")
def deployed(stack):
    deploy(stack)
    return stack


def det(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DET, *args], capture_output=True, text=True, timeout=timeout)


def create(config: str, name: str, *overrides: str) -> str:
    """``det experiment create CONFIG examples/core_api``; the new experiment's id."""
    args = [arg for item in (f"name={name}", *overrides) for arg in ("--config", item)]
    created = det("experiment", "create", str(EXAMPLES / config), str(EXAMPLES), *args)
    assert created.returncode == 0, created.stderr[-3000:]
    found = re.search(r"Created experiment (\w+)", created.stdout)
    assert found, created.stdout
    return found.group(1)


def trial_runs(client: Any, name: str) -> tuple[Any, list[Any]]:
    """The experiment's parent run and its trial runs (by trial id)."""
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, name
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    trials = sorted(
        (r for r in runs if "mlflow.parentRunId" in r.data.tags),
        key=lambda r: int(r.data.tags["det.trial_id"]),
    )
    return parent, trials


def history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_counter_run(client: Any, run: Any, increment_by: int, batches: int) -> list[dict]:
    """A finished counter trial as a PyTorchTrial's run looks: every report exact, its state
    COMPLETED, one checkpoint record per 10 batches in S3 under a ``runs:/`` URI."""
    run_id = run.info.run_id
    steps = range(10, batches + 1, 10)
    assert history(client, run_id, "training/x") == [(n, float(increment_by * n)) for n in steps]
    assert history(client, run_id, "validation/x") == [(batches, float(increment_by * batches))]
    assert [s for s, _ in history(client, run_id, "progress/batches")] == list(steps)
    finished = client.get_run(run_id)
    assert (finished.info.status, finished.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    records = checkpoint_records(client, run_id)
    assert [r["steps_completed"] for r in records] == list(steps)
    for record in records:
        assert set(record) == RECORD_KEYS
        assert record["uri"] == f"runs:/{run_id}/checkpoints/{record['uuid']}"
        assert record["s3_uri"].startswith("s3://") and record["bytes"] > 0
    return records


def test_det_experiment_create_of_a_core_api_script_without_max_length(deployed, tmp_path):
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = create(
        "checkpoints.yaml",
        "core-api-create",
        "hyperparameters.batches=40",
        "hyperparameters.increment_by=2",
        "checkpoint_storage.save_trial_latest=10",  # keep every checkpoint to check them all
    )
    waited = det("experiment", "wait", exp_id, "--polling-interval", "1", timeout=600)
    assert waited.returncode == 0, waited.stdout[-2000:] + waited.stderr[-2000:]
    parent, (trial,) = trial_runs(client, "core-api-create")
    records = assert_counter_run(client, trial, 2, 40)
    assert parent.data.tags["det.state"] == "COMPLETED"
    assert client.get_run(trial.info.run_id).data.params["hp.increment_by"] == "2"

    # det checkpoint download: the script's own files, sealed as a PyTorchTrial's are.
    out = tmp_path / "downloaded"
    got = det("checkpoint", "download", records[-1]["uuid"], "-o", str(out))
    assert got.returncode == 0, got.stderr[-2000:]
    trial_id = trial.data.tags["det.trial_id"]
    assert (out / "state").read_text() == f"80,40,{trial_id}"
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["steps_completed"] == 40


def test_prefect_deployment_run_of_a_core_api_script(deployed):
    from prefect.deployments import run_deployment

    flow_run = run_deployment(
        "experiment/const",
        parameters={
            "config": "examples/core_api/checkpoints.yaml",
            "overrides": [
                "name=core-api-deployment",
                "hyperparameters.batches=20",
                "hyperparameters.increment_by=3",
                "checkpoint_storage.save_trial_latest=10",
            ],
        },
        timeout=600,
    )
    assert flow_run.state is not None and flow_run.state.is_completed(), flow_run.state
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    parent, (trial,) = trial_runs(client, "core-api-deployment")
    assert parent.data.tags["det.experiment_run"] == str(flow_run.id)
    assert_counter_run(client, trial, 3, 20)


LAUNCHERS = [
    ("distributed.yaml", "core-api-torchrun"),
    pytest.param(
        "distributed_horovod.yaml",
        "core-api-horovod",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("horovod") is None,
            reason="Horovod is not installed (make horovod)",
        ),
    ),
]


@pytest.mark.parametrize(("config", "name"), LAUNCHERS)
def test_det_experiment_create_with_a_launcher(deployed, config, name):
    """Stage 4 (``python3 -m determined.launch.torch_distributed python3 4_distributed.py``,
    or ``determined.launch.horovod``; two ranks) through ``det experiment create``: the
    chief reports the ranks' sum, rank r adding ``increment_by * (r + 1)`` a batch, so
    2 * (1 + 2) * n after n batches; one sharded checkpoint holds both ranks' counters."""
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = create(config, name, "hyperparameters.batches=20")
    waited = det("experiment", "wait", exp_id, "--polling-interval", "1", timeout=600)
    assert waited.returncode == 0, waited.stdout[-2000:] + waited.stderr[-2000:]
    _, (trial,) = trial_runs(client, name)
    run_id = trial.info.run_id
    assert history(client, run_id, "training/x") == [(10, 60.0), (20, 120.0)]
    assert history(client, run_id, "validation/x") == [(20, 120.0)]
    assert client.get_run(run_id).data.tags["det.state"] == "COMPLETED"
    from registry.checkpoints.uris import fetch_checkpoint_uri

    newest = fetch_checkpoint_uri(checkpoint_records(client, run_id)[-1]["uri"])
    assert [(newest / f"state-{r}").read_text() for r in (0, 1)] == ["20,40", "20,80"]
