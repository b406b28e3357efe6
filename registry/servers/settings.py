"""Where the registry's services are, read once from the environment.

The names are the ones MLflow and boto3 already use (MLFLOW_TRACKING_URI,
MLFLOW_S3_ENDPOINT_URL, AWS_*), so pointing the platform at AWS S3 or a remote MLflow
is a matter of setting them; ``python -m infra.stack env`` prints them for the local stack.
DET_TASKS_ARTIFACT_ROOT (a directory) is where new MLflow experiments keep their artifacts
when the tracking store is local (the embedded mode). DET_TASKS_SYSTEM_METRICS_INTERVAL is
how often (seconds) trial runs sample CPU, memory, disk, network and GPU, plus one sample
when each trial's run ends; 0 turns it off. The default (1 s) gives steps of a few seconds
points of their own; sampling at 0.5-10 s cost no measurable step time
(bench/system_metrics.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from det_tasks.errors import ConfigError

__all__ = ["DEFAULT_SYSTEM_METRICS_INTERVAL_S", "RegistrySettings", "cache_dir"]

DEFAULT_SYSTEM_METRICS_INTERVAL_S = 1.0


def cache_dir() -> Path:
    """This installation's det-tasks cache (DET_TASKS_CACHE_DIR, else ~/.cache/det_tasks)."""
    return Path(os.environ.get("DET_TASKS_CACHE_DIR") or Path.home() / ".cache" / "det_tasks")


@dataclasses.dataclass(frozen=True)
class RegistrySettings:
    tracking_uri: str | None
    s3_endpoint: str | None
    bucket: str | None
    artifacts_destination: str | None
    cache_dir: Path
    artifact_root: str | None = None
    system_metrics_interval: float = DEFAULT_SYSTEM_METRICS_INTERVAL_S

    @classmethod
    def from_env(cls) -> RegistrySettings:
        return cls(
            tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
            s3_endpoint=os.environ.get("MLFLOW_S3_ENDPOINT_URL")
            or os.environ.get("AWS_ENDPOINT_URL"),
            bucket=os.environ.get("DET_TASKS_S3_BUCKET"),
            artifacts_destination=os.environ.get("DET_TASKS_MLFLOW_ARTIFACTS"),
            cache_dir=cache_dir(),
            artifact_root=os.environ.get("DET_TASKS_ARTIFACT_ROOT"),
            system_metrics_interval=_seconds(
                "DET_TASKS_SYSTEM_METRICS_INTERVAL", DEFAULT_SYSTEM_METRICS_INTERVAL_S
            ),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.tracking_uri)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(
            f"{name}={text!r} is not a number of seconds: give e.g. 10, or 0 to turn it off"
        )
    return value
