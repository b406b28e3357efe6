"""A throwaway MLflow server for a bench: SQLite store and local artifacts in a folder of the
bench's own, on a free loopback port, in a process group of its own (stop it with
``os.killpg``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["free_port", "mlflow_server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mlflow_server(root: Path, *server_args: str) -> tuple[subprocess.Popen[bytes], str]:
    """``mlflow server`` with ``server_args`` (``--workers``, ``--uvicorn-opts``...) on a
    store under ``root``, once it answers: (its process, its URI)."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
            "--port", str(port), "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
            "--default-artifact-root", str(root / "artifacts"), *server_args,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its group is stopped as a whole
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    from mlflow.tracking import MlflowClient

    deadline = time.monotonic() + 180
    while True:
        try:
            MlflowClient(uri).search_experiments(max_results=1)
            return proc, uri
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
