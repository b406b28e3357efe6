"""A stack exposed beyond loopback requires credentials everywhere: with ``auth`` the MLflow
server runs its basic-auth app and the Prefect server an API auth string; unauthenticated
or wrong-password requests are refused, while the platform's own clients (given the
generated credentials through the standard variables) train and log as before."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import StackConfig, down, env_for, service_auth, up

ROOT = Path(__file__).resolve().parents[2]
FLOW_MODEL = ROOT / "tests" / "fixtures" / "flow_model"


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth app needs flask-wtf")
    config = StackConfig(
        root=tmp_path_factory.mktemp("auth-stack"),
        s3_port=28433,
        master_port=29434,
        volume_port=28281,
        filer_port=29089,
        mlflow_port=25101,
        prefect_port=24300,
        auth=True,
    )
    try:
        up(config)
        yield config
    finally:
        down(config)


def _status(url: str, method: str = "GET", auth: str | None = None) -> int:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    request.add_header("Content-Type", "application/json")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_mlflow_refuses_requests_without_the_right_login(auth_stack: StackConfig) -> None:
    creds = service_auth(auth_stack)
    url = f"{auth_stack.mlflow_uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(url) == 401
    assert _status(url, auth=f"{creds['mlflow_username']}:wrong-password") == 401
    assert _status(url, auth=f"{creds['mlflow_username']}:{creds['mlflow_password']}") == 200
    assert _status(f"{auth_stack.mlflow_uri}/health") == 200  # probes stay open


def test_prefect_refuses_requests_without_the_auth_string(auth_stack: StackConfig) -> None:
    creds = service_auth(auth_stack)
    url = f"{auth_stack.prefect_api}/flows/filter"
    assert _status(url, "POST") == 401
    assert _status(url, "POST", auth="det-tasks:wrong") == 401
    assert _status(url, "POST", auth=creds["prefect_auth_string"]) == 200
    assert _status(f"{auth_stack.prefect_api}/health") == 200


def test_platform_clients_work_with_the_credentials(
    auth_stack: StackConfig, tmp_path: Path
) -> None:
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MLFLOW_", "AWS_", "PREFECT_", "DET_TASKS_"))
        },
        **env_for(auth_stack),
        "DET_TASKS_CACHE_DIR": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(FLOW_MODEL / "killable.yaml"),
            str(FLOW_MODEL),
            "--no-progress",
            "--param",
            "name=auth-check",
            "--param",
            "hyperparameters.sleep_s=0",
            "--max-batches",
            "30",
            "--summary-file",
            str(tmp_path / "summary.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["batches_trained"] == 30 and summary["checkpoint"].startswith("runs:/")
    run_id = summary["checkpoint"].split("/")[1]
    creds = service_auth(auth_stack)
    request = urllib.request.Request(
        f"{auth_stack.mlflow_uri}/api/2.0/mlflow/runs/get?run_id={run_id}"
    )
    login = f"{creds['mlflow_username']}:{creds['mlflow_password']}"
    request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    with urllib.request.urlopen(request, timeout=10) as response:
        run = json.loads(response.read())["run"]
    metric_keys = {m["key"] for m in run["data"].get("metrics", [])}
    assert "validation/validation_loss" in metric_keys
    assert run["info"]["status"] == "FINISHED"
