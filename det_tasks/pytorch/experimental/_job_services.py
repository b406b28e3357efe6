"""Where a batch-processing job's metrics, progress checkpoints, uploaded files and lineage go.

``BatchJobServices`` is the interface ``torch_batch_process`` writes through. Without
servers, ``LocalJobServices`` keeps everything under ``$DET_TASKS_HOME/jobs/<job id>/``;
with ``MLFLOW_TRACKING_URI`` set, the ``det_tasks.batch_services`` entry point (``registry``)
gives the MLflow run + S3 prefix of the job. det_tasks never imports either.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from det_tasks import plugins
from det_tasks.checkpoints.format import METADATA_FILE
from det_tasks.checkpoints.store import CheckpointStore, LocalDirectoryStore
from det_tasks.errors import ConfigError
from det_tasks.folder_names import checked_id
from det_tasks.home import det_tasks_home
from det_tasks.pytorch.experimental.job_environment import JOB_ID_ENV, JOB_OUTPUT_ENV

__all__ = [
    "JOB_ID_ENV",
    "JOB_OUTPUT_ENV",
    "BatchJobServices",
    "LocalJobServices",
    "job_services",
]


@runtime_checkable
class BatchJobServices(Protocol):
    checkpoint_store: CheckpointStore

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Metrics of the job (Determined's ``core.train.report_metrics``)."""

    def latest_progress(self) -> str | None:
        """The uuid of the job's newest progress checkpoint, if any."""

    def upload(self, local_dir: Path, relative: str) -> str:
        """Store the files under ``local_dir`` at ``relative`` in the job's output; its URI."""

    def output_uri(self, relative: str) -> str:
        """Where ``relative`` lands in the job's output (logged for the user)."""

    def set_tag(self, key: str, value: str) -> None:
        """Record a fact about the job (lineage) where users look for it."""

    def tensorboard_dir(self) -> Path:
        """A local directory whose event files are kept with the job."""

    def close(self, succeeded: bool) -> None:
        """Flush and finish."""


class LocalJobServices:
    """Everything in one directory: ``metrics.jsonl``, ``tags.json``, ``checkpoints/``,
    ``outputs/`` and ``tensorboard/`` under ``$DET_TASKS_HOME/jobs/<job id>``."""

    def __init__(self, root: Path, chief: bool = True) -> None:
        self.root = root
        self.chief = chief
        root.mkdir(parents=True, exist_ok=True)
        self.checkpoint_store = LocalDirectoryStore(root / "checkpoints")

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        line = {"group": group, "steps_completed": steps_completed, "metrics": metrics}
        with open(self.root / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=float) + "\n")

    def latest_progress(self) -> str | None:
        best: tuple[int, float, str] | None = None
        store_root = self.root / "checkpoints"
        for meta in store_root.glob(f"*/{METADATA_FILE}"):
            steps = json.loads(meta.read_text(encoding="utf-8")).get("steps_completed", 0)
            key = (int(steps), meta.stat().st_mtime, meta.parent.name)
            best = key if best is None or key > best else best
        return best[2] if best else None

    def upload(self, local_dir: Path, relative: str) -> str:
        target = self.root / "outputs" / relative
        shutil.copytree(local_dir, target, dirs_exist_ok=True)
        return target.as_uri()

    def output_uri(self, relative: str) -> str:
        return (self.root / "outputs" / relative).as_uri()

    def set_tag(self, key: str, value: str) -> None:
        path = self.root / "tags.json"
        tags = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        tags[key] = value
        tmp = path.with_name(f".tags-{os.getpid()}.json")
        tmp.write_text(json.dumps(tags, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    def tensorboard_dir(self) -> Path:
        path = self.root / "tensorboard"
        path.mkdir(exist_ok=True)
        return path

    def close(self, succeeded: bool) -> None:
        if self.chief:
            self.set_tag("status", "FINISHED" if succeeded else "FAILED")


def default_job_id() -> str:
    """``$DET_TASKS_JOB_ID`` (set it to resume a killed local job), else a fresh id."""
    chosen = os.environ.get(JOB_ID_ENV)
    if chosen:
        return checked_id(chosen, JOB_ID_ENV)
    return time.strftime("job-%Y%m%d-%H%M%S-") + str(os.getpid())


def job_services(
    job_id: str,
    experiment_name: str,
    chief: bool = True,
    run_id: str | None = None,
    writer: tuple[int, int] = (0, 1),
) -> Any:
    """MLflow + S3 when ``MLFLOW_TRACKING_URI`` is set (``run_id``: the chief's, shared with
    the other ranks; ``writer``: this rank and the job's size, all logging to that run),
    else the local directory. Only the chief finishes the job's run."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        factory = plugins.load_one("det_tasks.batch_services", "mlflow")
        if factory is None:
            raise ConfigError(
                "MLFLOW_TRACKING_URI is set but the registry package is not installed: "
                "pip install -e '.[platform]', or unset MLFLOW_TRACKING_URI to run locally"
            )
        return factory(job_id, experiment_name, chief=chief, run_id=run_id, writer=writer)
    return LocalJobServices(det_tasks_home() / "jobs" / job_id, chief=chief)
