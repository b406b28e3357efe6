"""`det model list|describe` read MLflow's model registry over its REST API (issue 53 item
3: every verb within a second; MLflow's client alone costs one). Here against a small HTTP
server that answers as MLflow 3.17's registry does (its JSON shapes and paging): the
models, versions, aliases and sources come out as before, across pages, and MLflow (or
Prefect, Dask, torch) is never imported."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_det_rest import FakeServers

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("mlflow", "prefect", "torch", "distributed", "boto3", "pandas")
# Three models; "mnist" has two versions, the second aliased champion.
MODELS = [
    {"name": "mnist", "aliases": [{"alias": "champion", "version": "2"}]},
    {"name": "xor"},
    {"name": "cifar", "aliases": []},
]
VERSIONS = {
    "mnist": [
        {"name": "mnist", "version": "1", "source": "s3://b/one", "run_id": "r1"},
        {"name": "mnist", "version": "2", "source": "s3://b/two", "run_id": "r2"},
    ],
    "xor": [{"name": "xor", "version": "1", "source": "s3://b/xor", "run_id": "r3"}],
    "cifar": [],
}


class Registry(FakeServers):
    """MLflow's registry routes (test_det_rest's JSON answers): models two to a page, so
    the reader must follow pages."""

    requests: list[str] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        Registry.requests.append(url.path)
        if url.path == "/api/2.0/mlflow/registered-models/search":
            start = int(query.get("page_token") or 0)
            body: dict[str, Any] = {"registered_models": MODELS[start : start + 2]}
            if start + 2 < len(MODELS):
                body["next_page_token"] = str(start + 2)
            return self._send(body)
        if url.path == "/api/2.0/mlflow/registered-models/get":
            found = [m for m in MODELS if m["name"] == query["name"]]
            if not found:
                message = f"Registered Model with name={query['name']} not found"
                return self._send(
                    {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": message}, 404
                )
            return self._send({"registered_model": found[0]})
        if url.path == "/api/2.0/mlflow/model-versions/search":
            name = query["filter"].removeprefix("name = '").removesuffix("'")
            return self._send({"model_versions": VERSIONS[name]})
        return self._send({"error_code": "ENDPOINT_NOT_FOUND", "message": "no"}, 404)


@contextlib.contextmanager
def serving(handler: type[FakeServers]) -> Iterator[str]:
    """``handler`` on a loopback port: its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def registry() -> Iterator[str]:
    Registry.requests = []
    with serving(Registry) as url:
        yield url


def det_alone(url: str, *argv: str) -> tuple[int, str, str, list[str]]:
    """``det ARGV`` in a fresh interpreter: (exit code, stdout, stderr, heavy modules)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DET_"))}
    env.update(MLFLOW_TRACKING_URI=url, PREFECT_API_URL=f"{url}/api", PYTHONPATH=str(ROOT),
               DET_TASKS_STACK_DIR="/nonexistent")  # fmt: skip
    code = (
        "import sys, json; from det_cli import main; rc = main(sys.argv[1:]); "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules])); sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=60
    )
    *lines, loaded = done.stdout.rstrip("\n").split("\n")
    return done.returncode, "\n".join(lines), done.stderr, json.loads(loaded)


def test_model_list_reads_every_page_without_mlflows_client(registry):
    rc, out, err, loaded = det_alone(registry, "model", "list")
    assert rc == 0, err
    assert loaded == []
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows == [
        ["mnist", "1", "s3://b/one"],
        ["mnist", "2", "champion", "s3://b/two"],
        ["xor", "1", "s3://b/xor"],
    ]
    assert out.splitlines()[0].split() == ["name", "version", "alias", "source"]
    assert Registry.requests.count("/api/2.0/mlflow/registered-models/search") == 2


def test_model_describe_one_and_a_missing_one(registry):
    rc, out, err, loaded = det_alone(registry, "model", "describe", "mnist")
    assert rc == 0, err
    assert loaded == []
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [
        ["mnist", "1", "s3://b/one"],
        ["mnist", "2", "champion"],
    ]
    rc, out, err, loaded = det_alone(registry, "model", "describe", "nope")
    assert rc == 1
    assert (
        err.strip() == "det: error: no registered model named 'nope' (`det model list` lists them)"
    )
    assert loaded == []


def test_a_registry_elsewhere_keeps_mlflows_client(monkeypatch):
    from registry.runs.mlflow_rest import MlflowReader, reader_for

    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    assert isinstance(reader_for("http://mlflow:5000"), MlflowReader)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "http://mlflow:5000/")
    assert isinstance(reader_for("http://mlflow:5000"), MlflowReader)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "databricks-uc")
    assert not isinstance(reader_for("http://mlflow:5000"), MlflowReader)


class Servers(FakeServers):
    """Prefect's deployment routes under /api and MLflow's experiment routes, recording
    what they are sent; ``experiments`` is MLflow's store (name -> record)."""

    sent: list[tuple[str, str, Any]] = []
    experiments: dict[str, dict[str, Any]] = {}

    def _record(self, method: str) -> tuple[str, dict[str, Any]]:
        url = urllib.parse.urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
        body.update(urllib.parse.parse_qsl(url.query))
        Servers.sent.append((method, url.path, body))
        return url.path, body

    def do_GET(self) -> None:
        path, query = self._record("GET")
        if path == "/api/deployments/name/experiment/sub%20mitted":
            return self._send({"id": "d" * 8, "name": "sub mitted"})
        if path == "/api/2.0/mlflow/experiments/get-by-name":
            found = Servers.experiments.get(query["experiment_name"])
            if found is None:
                return self._send({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"}, 404)
            return self._send({"experiment": found})
        return self._send({"detail": "Deployment not found"}, 404)

    def do_POST(self) -> None:
        path, body = self._record("POST")
        if path == f"/api/deployments/{'d' * 8}/create_flow_run":
            run = {"id": "1a2b3c4d-0000-4000-8000-000000000001", "name": "clever-fox"}
            return self._send({**run, "state_type": "SCHEDULED", "parameters": body["parameters"]})
        if path == "/api/2.0/mlflow/experiments/create":
            if body["name"] == "raced":  # another writer made it meanwhile
                Servers.experiments["raced"] = {"experiment_id": "9", "name": "raced", "tags": []}
                return self._send({"error_code": "RESOURCE_ALREADY_EXISTS", "message": "x"}, 400)
            return self._send({"experiment_id": "5"})
        return self._send({})


@pytest.fixture
def servers() -> Iterator[str]:
    Servers.sent, Servers.experiments = [], {}
    with serving(Servers) as url:
        yield url


def test_create_starts_its_flow_run_as_run_deployment_does(servers, monkeypatch):
    from det_tasks.errors import DetTasksError
    from flows import prefect_rest
    from flows.deployment_runs import start_deployment_run

    monkeypatch.setattr(prefect_rest, "prefect_loaded", lambda: False)
    monkeypatch.setenv("PREFECT_API_URL", f"{servers}/api")
    run = start_deployment_run("experiment/sub mitted", {"config": "x.yaml"}, ["det.user:ann"])
    assert str(run.id) == "1a2b3c4d-0000-4000-8000-000000000001"
    (_, found, _), (_, created, body) = Servers.sent
    assert found == "/api/deployments/name/experiment/sub%20mitted"
    assert created == f"/api/deployments/{'d' * 8}/create_flow_run"
    assert body["parameters"] == {"config": "x.yaml"} and body["tags"] == ["det.user:ann"]
    assert body["state"]["type"] == "SCHEDULED" and body["state"]["state_details"]["scheduled_time"]
    with pytest.raises(DetTasksError, match=r"could not start deployment 'experiment/gone' .*404"):
        start_deployment_run("experiment/gone", {})


def test_create_makes_the_mlflow_experiment_over_rest(servers, monkeypatch):
    from registry.runs.experiment_setup import EXPERIMENT_KIND, ensure_experiment
    from registry.runs.mlflow_rest import MlflowRestClient, writer_for
    from registry.runs.trials_view import TRIALS_VIEW_TAG

    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", "s3://bucket/runs")
    for name in ("MLFLOW_REGISTRY_URI", "MLFLOW_TRACKING_AUTH", "MLFLOW_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    client = writer_for(servers)
    assert isinstance(client, MlflowRestClient)
    assert ensure_experiment(client, "xor", "the XOR net") == "5"
    (_, _, body) = next(s for s in Servers.sent if s[1].endswith("experiments/create"))
    tags = {t["key"]: t["value"] for t in body["tags"]}
    assert tags["mlflow.experimentKind"] == EXPERIMENT_KIND
    assert tags["mlflow.note.content"] == "the XOR net" and TRIALS_VIEW_TAG in tags
    assert body["artifact_location"].startswith("s3://bucket/runs/xor-")
    # A deleted one is restored and tagged; one made meanwhile by another writer is taken.
    Servers.experiments["old"] = {"experiment_id": "3", "name": "old", "lifecycle_stage": "deleted",
                                  "tags": [{"key": TRIALS_VIEW_TAG, "value": "{}"}]}  # fmt: skip
    Servers.sent = []
    assert ensure_experiment(client, "old") == "3"
    assert [(p.rsplit("/", 1)[-1], b.get("key")) for m, p, b in Servers.sent if m == "POST"] == [
        ("restore", None),
        ("set-experiment-tag", "mlflow.experimentKind"),
    ]
    assert ensure_experiment(client, "raced") == "9"
