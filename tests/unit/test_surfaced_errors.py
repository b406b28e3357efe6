"""Issue 15 item 14, swallowed errors: each failure now names its real cause."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, RESOURCE_DOES_NOT_EXIST

from det_tasks.errors import CheckpointError, DetTasksError
from registry.checkpoints.store import CHECKPOINT_TAG, forget_checkpoint_record


class _Client:
    """Stands in for MlflowClient.delete_tag only (a single-function unit test)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.deleted: list[tuple[str, str]] = []

    def delete_tag(self, run_id: str, key: str) -> None:
        if self.error is not None:
            raise self.error
        self.deleted.append((run_id, key))


def test_record_deletion_failure_after_data_is_gone_names_the_cause():
    client = _Client(ConnectionError("Connection refused"))
    with pytest.raises(CheckpointError) as err:
        forget_checkpoint_record(client, "run1", "abc", "s3://b/p/checkpoints/abc")  # type: ignore[arg-type]
    message = str(err.value)
    assert "s3://b/p/checkpoints/abc were deleted" in message
    assert f"tag {CHECKPOINT_TAG}abc on run run1" in message
    assert "ConnectionError: Connection refused" in message


def test_record_already_gone_is_fine():
    missing = MlflowException("no such tag", error_code=RESOURCE_DOES_NOT_EXIST)
    forget_checkpoint_record(_Client(missing), "run1", "abc", "s3://b/x")  # type: ignore[arg-type]
    client = _Client(None)
    forget_checkpoint_record(client, "run1", "abc", "s3://b/x")  # type: ignore[arg-type]
    assert client.deleted == [("run1", f"{CHECKPOINT_TAG}abc")]


def test_other_mlflow_errors_are_raised():
    denied = MlflowException("forbidden", error_code=PERMISSION_DENIED)
    with pytest.raises(CheckpointError, match="forbidden"):
        forget_checkpoint_record(_Client(denied), "r", "u", "s3://b/x")  # type: ignore[arg-type]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_experiment_lookup_with_the_server_down_says_so(monkeypatch):
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from det_cli.submission import _find_flow_run

    url = f"http://127.0.0.1:{_closed_port()}/api"
    start = time.monotonic()
    settings = {PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 0}
    with temporary_settings(settings), pytest.raises(DetTasksError) as err:
        _find_flow_run(str(uuid.uuid4()))
    message = str(err.value)
    assert "no experiment run" not in message
    assert f"the Prefect server at {url} failed" in message
    assert "ConnectError" in message or "Connect" in message
    assert time.monotonic() - start < 60
