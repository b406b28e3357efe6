"""The metrics sink's kept HTTP session against a local HTTP server standing in for MLflow's
log-batch endpoint: the credentials MLflow's client would send (netrc and a CA bundle from
the environment included), worked out once; a refused batch (4xx) reported and dropped, not
retried forever; an overloaded server (5xx, 408, 429) retried; refused credentials read
again and retried."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from registry.metrics.sink import MlflowMetricsSink
from registry.servers.rest_session import RestSession


class Endpoint:
    """Answers POSTs with ``statuses`` in turn (then 200) and records what arrived."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.requests: list[tuple[dict[str, str], bytes]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.requests.append((dict(self.headers), body))
                status = endpoint.statuses.pop(0) if endpoint.statuses else 200
                answer = b"{}" if status == 200 else b'{"error_code": "INVALID_PARAMETER_VALUE"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    served = Endpoint()
    yield served
    served.server.shutdown()
    served.server.server_close()


@pytest.mark.parametrize(
    ("env", "authorization"),
    [
        ({"MLFLOW_TRACKING_TOKEN": "t0ken"}, "Bearer t0ken"),
        ({"MLFLOW_TRACKING_USERNAME": "ann", "MLFLOW_TRACKING_PASSWORD": "pw"}, "Basic YW5uOnB3"),
        ({}, None),
    ],
)
def test_the_session_sends_the_credentials_mlflow_would(
    endpoint: Endpoint,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    authorization: str | None,
) -> None:
    for name in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    session = RestSession(endpoint.url)
    for _ in range(2):
        assert session.post("/api/2.0/mlflow/runs/log-batch", b'{"a": 1}').status_code == 200
    session.close()
    headers, body = endpoint.requests[-1]
    assert body == b'{"a": 1}'
    assert headers.get("Authorization") == authorization
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"].startswith("mlflow-python-client")


class NoHistory:
    """The read side of a fresh run: nothing stored yet."""

    def __init__(self, url: str) -> None:
        self.tracking_uri = url

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(data=SimpleNamespace(metrics={}))

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return []


def _sent(endpoint: Endpoint) -> list[tuple[str, int]]:
    return [
        (m["key"], m["step"]) for _, body in endpoint.requests for m in json.loads(body)["metrics"]
    ]


def test_a_refused_batch_is_reported_and_dropped_and_later_batches_still_arrive(
    endpoint: Endpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint.statuses = [400]
    sink = MlflowMetricsSink(NoHistory(endpoint.url), "run", spill_dir=tmp_path)  # type: ignore[arg-type]
    sink.report_training(1, {"loss": 1.0})
    assert sink.flush(timeout_s=10) is True
    sink.report_training(2, {"loss": 0.5})
    sink.close()
    assert sink.rejected_points == 1 and sink.sent_points == 1 and sink.failures == 0
    assert _sent(endpoint) == [("training/loss", 1), ("training/loss", 2)]
    assert "MLflow refused 1 metric points for run run (HTTP 400)" in caplog.text


@pytest.mark.parametrize("status", [503, 507, 408, 429, 401])
def test_an_overloaded_server_or_refused_credentials_are_retried_until_the_batch_is_stored(
    endpoint: Endpoint, tmp_path: Path, status: int
) -> None:
    endpoint.statuses = [status]
    sink = MlflowMetricsSink(NoHistory(endpoint.url), "run", spill_dir=tmp_path)  # type: ignore[arg-type]
    first_session = sink._rest
    sink.report_training(1, {"loss": 1.0})
    sink.close()
    assert sink.failures == 1 and sink.sent_points == 1 and sink.rejected_points == 0
    assert _sent(endpoint) == [("training/loss", 1), ("training/loss", 1)]  # sent, then again
    # Refused credentials are read again (a rotated token); other answers keep the session.
    assert (sink._rest is not first_session) == (status == 401)


def test_the_session_reads_the_ca_bundle_and_netrc_once_as_requests_would(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "corporate-ca.pem"))
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login ann password pw\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    session = RestSession(endpoint.url)
    assert session._session is not None
    assert session._session.verify == str(tmp_path / "corporate-ca.pem")
    assert session.post("/api/2.0/mlflow/runs/log-batch", b"{}").status_code == 200
    session.close()
    assert endpoint.requests[-1][0].get("Authorization") == "Basic YW5uOnB3"
