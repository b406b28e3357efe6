"""The no-server default: with no MLFLOW_TRACKING_URI, a local MLflow SQLite store and
artifact directory in the installation's folder (det_tasks.home); with no PREFECT_API_URL,
Prefect's own ephemeral server. Variables the user set always win, so the same entry points
run against a real stack unchanged."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from det_tasks.first_use import create_once
from det_tasks.home import det_tasks_home

__all__ = ["start_shielded_prefect_server", "use_embedded_defaults"]


def use_embedded_defaults() -> dict[str, str]:
    """Fill in what is unset for a run without servers; returns what was set, so the caller
    can tell the user where to look."""
    chosen: dict[str, str] = {}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        home = det_tasks_home().resolve()
        home.mkdir(parents=True, exist_ok=True)
        chosen["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
        if not os.environ.get("DET_TASKS_ARTIFACT_ROOT"):
            chosen["DET_TASKS_ARTIFACT_ROOT"] = str(home / "artifacts")
    if not os.environ.get("PREFECT_API_URL"):
        # The ephemeral server otherwise logs an error per start when it cannot phone home.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for name, value in chosen.items():
        os.environ[name] = value
    return chosen


def start_shielded_prefect_server() -> None:
    """Start Prefect's ephemeral server now, with SIGINT blocked while it is spawned: the
    child keeps that mask, so a terminal's Ctrl-C (sent to the whole
    foreground process group) stops the experiment gracefully instead of killing the API
    the flow still needs to record its stop. The flow's own process unblocks at once and
    reuses this server (Prefect keeps one per process), and stops it by SIGTERM at exit.
    No-op with PREFECT_API_URL set."""
    if os.environ.get("PREFECT_API_URL"):
        return
    database = _prefect_sqlite_database()
    if database is None:
        _start_ephemeral_server()
    else:  # the first start in a fresh home creates the schema; others wait for it
        create_once(database, _start_ephemeral_server)
        _start_ephemeral_server()  # no-op when create_once just started it


def _start_ephemeral_server() -> None:
    from prefect.client.orchestration import get_client

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with get_client(sync_client=True) as client:
            client.api_healthcheck()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _prefect_sqlite_database() -> Path | None:
    """The SQLite file the ephemeral server will use, or None for another database."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    text = url.get_secret_value() if url is not None else ""
    if not text.startswith("sqlite"):
        return None
    return Path(text.split(":///", 1)[1]).expanduser()
