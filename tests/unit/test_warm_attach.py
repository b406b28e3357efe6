"""A run attaches to the home's warm services (infra.warm_home) only when they answer and
it would record where their workers record; otherwise it starts its own, as without them."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_tasks.home import RECORDING_SETTINGS, warm_services_file
from flows.embedded import WarmServices, attach_warm_services


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args: object) -> None:
        pass


SETTINGS = ("PREFECT_", "MLFLOW_", "DET_TASKS_", "AWS_")  # every recording setting's prefix


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home with no user settings that could choose a server or a store; what attaching
    set is removed afterwards (monkeypatch only restores what it changed itself), so no
    later test records to this home."""
    for name in list(os.environ):
        if name.startswith(SETTINGS):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "det"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "det"
    for name in [n for n in os.environ if n.startswith(SETTINGS)]:
        del os.environ[name]  # then monkeypatch puts back what it found


@pytest.fixture
def answering() -> Iterator[tuple[int, int]]:
    """A Prefect health endpoint and a listening "scheduler" port, both on loopback."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with socket.socket() as scheduler:
        scheduler.bind(("127.0.0.1", 0))
        scheduler.listen()
        yield server.server_address[1], scheduler.getsockname()[1]
    server.shutdown()


def _record(home: Path, prefect_port: int, dask_port: int, **more: str) -> dict[str, str]:
    """A record as infra.warm_home writes it, for workers started from a clean shell."""
    recorded = {
        **dict.fromkeys(RECORDING_SETTINGS, ""),
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "DET_TASKS_DASK_SCHEDULER": f"tcp://127.0.0.1:{dask_port}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "DET_TASKS_ARTIFACT_ROOT": str(home / "artifacts"),
        "workers": "2",
        **more,
    }
    warm_services_file().parent.mkdir(parents=True)
    warm_services_file().write_text(json.dumps(recorded))
    return recorded


CHOSEN = ("PREFECT_API_URL", "DET_TASKS_DASK_SCHEDULER", "MLFLOW_TRACKING_URI")


def test_answering_services_are_used_with_the_homes_store(
    home: Path, answering: tuple[int, int]
) -> None:
    recorded = _record(home, *answering)
    assert attach_warm_services() == WarmServices(
        prefect_api=recorded["PREFECT_API_URL"],
        scheduler=recorded["DET_TASKS_DASK_SCHEDULER"],
        tracking_uri=recorded["MLFLOW_TRACKING_URI"],
        workers=2,
    )
    for name in (*CHOSEN, "DET_TASKS_ARTIFACT_ROOT"):
        assert os.environ[name] == recorded[name]


def test_no_record_or_a_stale_one_starts_its_own(home: Path) -> None:
    assert attach_warm_services() is None
    with socket.socket() as probe:  # ports nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    _record(home, closed, closed)
    assert attach_warm_services() is None
    assert not any(name in os.environ for name in CHOSEN)


def test_a_store_of_the_users_own_is_not_given_to_warm_workers(
    home: Path, answering: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm workers record to the home's store: a run told to record elsewhere must not
    run its trials there."""
    _record(home, *answering)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert attach_warm_services() is None
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    for name, value in [
        ("DET_TASKS_ARTIFACT_ROOT", "/elsewhere"),
        ("MLFLOW_S3_ENDPOINT_URL", "http://127.0.0.1:8333"),
        ("DET_TASKS_MLFLOW_ARTIFACTS", "s3://bucket/prefix"),
        ("DET_TASKS_SYSTEM_METRICS_INTERVAL", "0"),
    ]:
        monkeypatch.setenv(name, value)
        assert attach_warm_services() is None, name
        monkeypatch.delenv(name)
    assert not any(name in os.environ for name in ("PREFECT_API_URL", "DET_TASKS_DASK_SCHEDULER"))
    assert attach_warm_services() is not None  # and with none of them set, it attaches


@pytest.mark.parametrize(
    "name, value",
    [("DET_TASKS_WARM_SERVICES", "0"), ("DET_TASKS_WORKER_MEMORY_MB", "1024")],
    ids=["opted-out", "embedded-workers-sized"],
)
def test_the_user_can_keep_a_run_on_its_own_cluster(
    home: Path,
    answering: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str,
) -> None:
    _record(home, *answering)
    monkeypatch.setenv(name, value)
    assert attach_warm_services() is None


@pytest.mark.parametrize("chosen", ["PREFECT_API_URL", "DET_TASKS_DASK_SCHEDULER"])
def test_a_server_of_the_users_own_wins(
    home: Path, answering: tuple[int, int], monkeypatch: pytest.MonkeyPatch, chosen: str
) -> None:
    _record(home, *answering)
    monkeypatch.setenv(chosen, "http://elsewhere:1")
    assert attach_warm_services() is None
    assert os.environ[chosen] == "http://elsewhere:1"


def test_a_trial_needing_more_gpus_than_a_warm_worker_owns_starts_its_own(
    home: Path, answering: tuple[int, int]
) -> None:
    """On a GPU host each warm worker owns one GPU: a 2-slot trial would find no worker."""
    _record(home, *answering, workers="4", gpus_per_worker="1")
    assert attach_warm_services(slots_per_trial=2) is None
    assert attach_warm_services(slots_per_trial=1) is not None


def test_a_gpu_worker_sees_and_advertises_only_its_own_gpu(tmp_path: Path) -> None:
    """What infra.warm_home starts on a GPU host (no GPU here: the command line is checked)."""
    from infra.dask_cluster import worker_service

    service = worker_service(tmp_path, "tcp://127.0.0.1:1", "dask-worker-gpu3", gpus=[3])
    at = service.argv.index("--resources")
    assert service.argv[at + 1] == "pool-default=1 GPU=1"  # and its pool (cluster.pools)
    assert service.env["CUDA_VISIBLE_DEVICES"] == "3"
    cpu = worker_service(tmp_path, "tcp://127.0.0.1:1", "dask-worker-0")
    at = cpu.argv.index("--resources")
    assert cpu.argv[at + 1] == "pool-default=1" and "CUDA_VISIBLE_DEVICES" not in cpu.env


def test_start_refuses_a_shell_pointed_at_servers(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `source .stack/env` the warm workers would record elsewhere than the runs
    that use them: start says so and starts nothing."""
    from infra import warm_home
    from infra.services import ServiceError

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5001")
    with pytest.raises(ServiceError, match="PREFECT_API_URL, MLFLOW_TRACKING_URI set"):
        warm_home.start()
    assert not warm_services_file().parent.exists()
