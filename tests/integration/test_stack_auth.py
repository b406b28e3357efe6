"""A stack exposed beyond loopback requires credentials everywhere: with ``auth`` the MLflow
server runs its basic-auth app and the Prefect server an API auth string; unauthenticated
or wrong-password requests are refused, while the platform's own clients (given the
generated credentials through the standard variables) train and log as before."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import StackConfig, down, env_for, service_auth, up
from tests.integration.helpers import (
    FLOW_MODEL,
    env_without_platform,
    isolated_stack_config,
    run_xor_trial,
)


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth app needs flask-wtf")
    config = isolated_stack_config(
        # No Dask workers: these tests use `det-tasks run` and HTTP only.
        tmp_path_factory.mktemp("auth-stack"),
        100,
        auth=True,
        dask_workers=0,
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
    env = env_without_platform(**env_for(auth_stack), DET_TASKS_CACHE_DIR=str(tmp_path / "cache"))
    proc = run_xor_trial(
        "auth-check", 30, env, FLOW_MODEL, "--summary-file", str(tmp_path / "summary.json")
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
