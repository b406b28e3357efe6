"""The no-server default: with no MLFLOW_TRACKING_URI, a local MLflow SQLite store and
artifact directory; with no PREFECT_API_URL, Prefect's own ephemeral server. Variables the
user set always win, so the same entry points run against a real stack unchanged."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EMBEDDED_HOME_ENV", "embedded_home", "use_embedded_defaults"]

EMBEDDED_HOME_ENV = "DET_TASKS_HOME"


def embedded_home() -> Path:
    """Where the embedded MLflow store and artifacts live (``$DET_TASKS_HOME`` or
    ``~/.det_tasks``)."""
    return Path(os.environ.get(EMBEDDED_HOME_ENV) or Path.home() / ".det_tasks").expanduser()


def use_embedded_defaults() -> dict[str, str]:
    """Fill in what is unset for a run without servers; returns what was set, so the caller
    can tell the user where to look."""
    chosen: dict[str, str] = {}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        home = embedded_home().resolve()
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
