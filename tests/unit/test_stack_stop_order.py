"""infra.stack.down stops each service once those that write through it are gone (workers,
then the servers they used, then S3 after MLflow, which proxies uploads to it, then
PostgreSQL), and SeaweedFS's stop ends its lingering once its filer stopped listening."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from infra import seaweed, stack
from infra.services import Service
from infra.stack_config import StackConfig


def test_down_stops_each_service_after_those_that_write_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waves: list[list[str]] = []

    def record(services: Sequence[Service]) -> list[bool]:
        waves.append([s.name for s in services])
        return [False] * len(services)

    monkeypatch.setattr(stack, "stop_all", record)
    monkeypatch.setattr(stack, "stop", lambda service: record([service])[0])
    monkeypatch.setattr(seaweed, "_weed_binary", lambda: "weed")
    config = StackConfig(root=tmp_path, postgres_port=25432, dask_workers=2)
    monkeypatch.setattr(stack.postgres, "_bin", lambda name: name)
    stack.down(config)
    assert waves == [
        ["prefect-worker", "flow-starter", "dask-worker-0", "dask-worker-1"],
        ["prefect-server", "dask-scheduler", "mlflow"],
        ["seaweedfs"],
        ["postgres"],
    ]


def test_seaweedfs_stop_is_done_once_its_filer_stops_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seaweed, "_weed_binary", lambda: "weed")
    with socket.socket() as grpc, socket.socket() as http:
        http.bind(("127.0.0.1", 0))
        grpc.bind(("127.0.0.1", 0))
        filer, filer_grpc = http.getsockname()[1], grpc.getsockname()[1]
        config = StackConfig(root=tmp_path, filer_port=filer, seaweed_grpc_shift=filer_grpc - filer)
        done = seaweed.seaweed_service(config).stop_done
        assert done is not None
        http.listen()
        grpc.listen()
        assert not done()
        http.close()  # the HTTP port closed, gRPC still open: not yet
        assert not done()
    assert done()
