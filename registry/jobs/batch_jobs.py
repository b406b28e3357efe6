"""The MLflow run and S3 prefix of a batch-processing job (``torch_batch_process``).

Found by the ``det_tasks.batch_services`` entry point. One MLflow run per job, found again
by its ``det.job_id`` tag, so a restarted job reports into the same run and resumes from
its progress checkpoints (recorded on that run). Files from ``upload_path()`` go under the
job's output prefix (``$DET_TASKS_JOB_OUTPUT``, else ``s3://<bucket>/jobs/<job id>``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from det_tasks.folder_names import checked_id
from det_tasks.pytorch.harness import JOB_OUTPUT_ENV
from registry.checkpoints.store import S3CheckpointStore, checkpoint_records
from registry.metrics.sink import MlflowMetricsSink
from registry.metrics.tensorboard_upload import upload_tensorboard
from registry.runs.tracking import client_for, ensure_experiment
from registry.servers import s3 as s3_lib
from registry.servers.local_files import FileLocation
from registry.servers.settings import RegistrySettings

__all__ = ["JOB_TAG", "MlflowJobServices", "find_job_run", "job_output_uri"]

JOB_TAG = "det.job_id"


def job_output_uri(job_id: str, settings: RegistrySettings | None = None) -> str:
    """Where a job's files go unless ``$DET_TASKS_JOB_OUTPUT`` says otherwise."""
    settings = settings or RegistrySettings.from_env()
    checked_id(job_id, "the job id")
    if os.environ.get(JOB_OUTPUT_ENV):
        return os.environ[JOB_OUTPUT_ENV]
    if settings.artifact_root and not settings.s3_endpoint:
        return (Path(settings.artifact_root).expanduser().resolve() / "jobs" / job_id).as_uri()
    return f"s3://{settings.bucket or 'det-tasks'}/jobs/{job_id}"


def find_job_run(client: Any, experiment_name: str, job_id: str, create: bool = True) -> str | None:
    """The run tagged ``det.job_id = job_id`` in ``experiment_name`` (created if missing)."""
    experiment_id = ensure_experiment(client, experiment_name)
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1
    )
    if runs:
        return str(runs[0].info.run_id)
    if not create:
        return None
    run = client.create_run(experiment_id, run_name=f"job-{job_id[:12]}", tags={JOB_TAG: job_id})
    return str(run.info.run_id)


class MlflowJobServices:
    """``BatchJobServices`` over a job's MLflow run (metrics, progress checkpoints, tags)
    and its S3 output prefix (``upload_path()`` files)."""

    def __init__(
        self,
        job_id: str,
        experiment_name: str,
        chief: bool = True,
        run_id: str | None = None,
        writer: tuple[int, int] = (0, 1),
    ) -> None:
        self.chief = chief
        settings = RegistrySettings.from_env()
        assert settings.tracking_uri, "MlflowJobServices needs MLFLOW_TRACKING_URI"
        self.client = client_for(settings.tracking_uri)
        found = run_id or find_job_run(self.client, experiment_name, job_id)
        assert found is not None
        self.run_id: str = found
        self.s3 = s3_lib.client(settings.s3_endpoint)
        self.output = s3_lib.parse_location(job_output_uri(job_id, settings))
        if chief:
            self.client.set_tag(self.run_id, "det.output", self.output.uri)
        self.sink = MlflowMetricsSink(
            self.client,
            self.run_id,
            spill_dir=settings.cache_dir / "spill" / self.run_id / str(writer[0]),
            writer=writer,
        )
        self.checkpoint_store = S3CheckpointStore(
            self.client,
            self.s3,
            self.run_id,
            artifacts_destination=settings.artifacts_destination,
            cache_dir=settings.cache_dir,
        )
        self._tensorboard: Path | None = None

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.sink.report_metrics(group, steps_completed, metrics)

    def latest_progress(self) -> str | None:
        records = checkpoint_records(self.client, self.run_id)
        return str(records[-1]["uuid"]) if records else None

    def upload(self, local_dir: Path, relative: str) -> str:
        target = self.output.child(relative)
        if isinstance(target, FileLocation):  # merge, as S3 puts do (no directory swap)
            shutil.copytree(local_dir, target.path, dirs_exist_ok=True)
        else:
            s3_lib.upload_dir(self.s3, local_dir, target)
        return target.uri

    def output_uri(self, relative: str) -> str:
        return self.output.child(relative).uri

    def set_tag(self, key: str, value: str) -> None:
        """Every rank may set the same tag (Determined's ``report_task_using_checkpoint``
        runs on each). MLflow's SQL store adds a new tag by a select then an insert, so two
        ranks setting it at once can collide: one gets HTTP 400, "UNIQUE constraint
        failed" (a CI run lost a whole job to it). After a refusal the tag is read back:
        holding the value, it is done; otherwise it is set again, and a second refusal
        stands."""
        try:
            self.client.set_tag(self.run_id, key, value)
        except MlflowException:
            if self.client.get_run(self.run_id).data.tags.get(key) == value:
                return
            self.client.set_tag(self.run_id, key, value)

    def tensorboard_dir(self) -> Path:
        if self._tensorboard is None:
            self._tensorboard = Path(tempfile.mkdtemp(prefix="det-tasks-tb-"))
        return self._tensorboard

    def close(self, succeeded: bool) -> None:
        self.checkpoint_store.close()
        self.sink.close()
        if self._tensorboard is not None:  # never raises: the job's outputs are its work
            upload_tensorboard(self.client, self.run_id, self._tensorboard)
        if succeeded and self.chief:
            self.client.set_terminated(self.run_id, status="FINISHED")
