"""The installation's own folder: ``$DET_TASKS_HOME``, else ``~/.det_tasks``. It holds what
belongs to this installation rather than to a run: the checkpoint signing key, and the
no-server mode's MLflow store and artifacts."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = [
    "HOME_ENV",
    "RECORDING_SETTINGS",
    "det_tasks_home",
    "no_server_recording",
    "warm_record",
    "warm_services_file",
]

HOME_ENV = "DET_TASKS_HOME"


def det_tasks_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".det_tasks").expanduser()


def no_server_recording(home: Path) -> dict[str, str]:
    """Where a run without servers records (the MLflow store and artifact folder in
    ``home``): the embedded mode's defaults, and what the home's warm workers are given."""
    home = home.resolve()
    return {
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "DET_TASKS_ARTIFACT_ROOT": str(home / "artifacts"),
    }


def warm_services_file() -> Path:
    """Where ``python -m infra.warm_home start`` records the warm Prefect server and Dask
    cluster it keeps for this home, and where an embedded run looks for them."""
    return det_tasks_home() / "warm" / "services.json"


def warm_record() -> dict[str, str]:
    """What ``python -m infra.warm_home start`` recorded, values as text; {} when there is
    no record or it is not a JSON object (a stale or hand-edited file is no record)."""
    try:
        recorded = json.loads(warm_services_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {str(k): str(v) for k, v in recorded.items()}


# The environment variables that decide where and how a trial records (registry.servers.settings):
# a run may use warm workers only where they see the same values as the run.
RECORDING_SETTINGS = (
    "MLFLOW_TRACKING_URI",
    "DET_TASKS_ARTIFACT_ROOT",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL",
    "DET_TASKS_S3_BUCKET",
    "DET_TASKS_MLFLOW_ARTIFACTS",
    "DET_TASKS_SYSTEM_METRICS_INTERVAL",
)
