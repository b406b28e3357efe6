"""The S3 checkpoint store: bytes in S3 under the trial run's artifacts, a record in MLflow.

``publish`` returns at once; the upload runs on a background thread (the training thread
only paid for writing the state to local disk). ``metadata.json`` is uploaded last, as the
commit marker, and only then is the checkpoint recorded on the run (a ``det.checkpoint.*``
tag with its step and validation metrics), so a reader never finds a half-uploaded one. A
record is read back (GC, resume, the best checkpoint), so it is kept whole at any size
(``registry.runs.large_tags``): a few hundred validation metrics outgrow one MLflow tag.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import threading
import uuid as uuid_lib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.checkpoints.format import METADATA_FILE, read_json, seal, verify
from det_tasks.errors import CheckpointError
from registry.checkpoints.cache import fetch_checkpoint
from registry.metrics.sink import MlflowMetricsSink
from registry.runs import run_records
from registry.runs.large_tags import load_large_tags, save_large_tag
from registry.runs.run_lease import RunLease
from registry.runs.run_records import rank_by_metric, validation_value
from registry.servers.s3 import Location, artifact_location, delete_prefix, upload_dir

__all__ = [
    "CHECKPOINT_TAG",
    "S3CheckpointStore",
    "checkpoint_records",
    "forget_checkpoint_record",
    "rank_by_metric",
    "record_checkpoint",
    "resolve_checkpoint_uuid",
    "run_checkpoint_location",
    "validation_value",
]

log = logging.getLogger(__name__)
# How long a checkpoint's record waits for the metrics reported before it (the sink's own
# close timeout): past it, MLflow is down, and the record is tried (and retried) anyway.
METRICS_BEFORE_RECORD_S = 120.0
CHECKPOINT_TAG = run_records.CHECKPOINT_TAG  # one spelling, which det reads without MLflow


def run_checkpoint_location(
    client: MlflowClient, run_id: str, artifacts_destination: str | None, uuid: str
) -> Location:
    """Where a checkpoint's bytes go: ``checkpoints/<uuid>`` under the run's artifact root
    (an S3 prefix, or a local directory in the embedded mode)."""
    artifact_uri = client.get_run(run_id).info.artifact_uri
    base = artifact_location(artifact_uri, artifacts_destination, f"run {run_id}")
    return base.child(f"checkpoints/{uuid}")


def forget_checkpoint_record(client: MlflowClient, run_id: str, uuid: str, where: str) -> None:
    """Remove a checkpoint's MLflow record after its bytes at ``where`` were deleted.

    A record that is already gone is fine (deleting twice is harmless); any other failure
    is raised with its cause, because the record now points at data that no longer exists.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.delete_tag(run_id, f"{CHECKPOINT_TAG}{uuid}")
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return
        raise CheckpointError(_record_left(uuid, run_id, where, err)) from err
    except Exception as err:  # the MLflow server is unreachable, refuses auth, ...
        raise CheckpointError(_record_left(uuid, run_id, where, err)) from err


def _record_left(uuid: str, run_id: str, where: str, err: Exception) -> str:
    return (
        f"checkpoint {uuid}: its files at {where} were deleted, but removing its MLflow record "
        f"(tag {CHECKPOINT_TAG}{uuid} on run {run_id}) failed: {type(err).__name__}: {err}. "
        "The record now points at deleted data; fix the cause and delete again (deleting "
        "twice is harmless)"
    )


def resolve_checkpoint_uuid(uuid: str) -> str:
    """The ``runs:/`` URI of the checkpoint with this uuid, in any experiment of the
    configured MLflow (a warm start's ``searcher.source_checkpoint_uuid``)."""
    from det_tasks.errors import DetTasksError
    from registry.runs.tracking import client_for
    from registry.servers.settings import RegistrySettings

    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise DetTasksError(f"checkpoint {uuid!r}: finding it needs MLFLOW_TRACKING_URI")
    if not re.fullmatch(r"[0-9A-Za-z-]{8,64}", uuid):
        raise DetTasksError(f"{uuid!r} is not a checkpoint uuid")
    client = client_for(settings.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        experiments, filter_string=f"tags.`{CHECKPOINT_TAG}{uuid}` LIKE '%'", max_results=2
    )
    if not runs:
        raise DetTasksError(f"no MLflow run records a checkpoint with uuid {uuid!r}")
    return f"runs:/{runs[0].info.run_id}/checkpoints/{uuid}"


def record_checkpoint(client: MlflowClient, run_id: str, record: dict[str, Any]) -> None:
    """Record a checkpoint on its run: the ``det.checkpoint.<uuid>`` tag, whole at any size
    (``checkpoint_records`` reads it back)."""
    name = f"{CHECKPOINT_TAG}{record['uuid']}"
    save_large_tag(client, run_id, name, json.dumps(record), "report fewer validation metrics")


def checkpoint_records(client: MlflowClient, run_id: str) -> list[dict[str, Any]]:
    """Every checkpoint recorded on a run, oldest first."""
    tags = client.get_run(run_id).data.tags
    records = [json.loads(v) for v in load_large_tags(tags, CHECKPOINT_TAG).values()]
    return sorted(records, key=lambda r: r["steps_completed"])


class S3CheckpointStore:
    """CheckpointStore for one trial run."""

    def __init__(
        self,
        client: MlflowClient,
        s3: Any,
        run_id: str,
        *,
        artifacts_destination: str | None,
        cache_dir: Path,
        lease: RunLease | None = None,
        metrics: MlflowMetricsSink | None = None,
    ) -> None:
        self.client = client
        self.lease = lease  # registry.runs.run_lease: a fenced process records no checkpoint
        self.metrics = metrics  # the run's sink: what was reported before it goes first
        self.s3 = s3
        self.run_id = run_id
        self.artifacts_destination = artifacts_destination
        self.cache_dir = cache_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._uploads: dict[str, Future[None]] = {}
        self._reported: set[str] = set()
        self._lock = threading.Lock()

    def location(self, uuid: str) -> Location:
        return run_checkpoint_location(self.client, self.run_id, self.artifacts_destination, uuid)

    def stage(self) -> Path:
        """``<cache>/published/<uuid>``: kept after the upload as this host's copy of the
        checkpoint, so the path a callback recorded stays readable (and restore skips the
        download); deleting the checkpoint removes it too."""
        path = self._local_copy(str(uuid_lib.uuid4()))
        path.mkdir(parents=True)
        return path

    def _local_copy(self, uuid: str) -> Path:
        return self.cache_dir / "published" / uuid

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        """Returns at once: checksums and upload run on the upload thread."""
        uuid = staged.name
        location = self.location(uuid)
        reported = self.metrics.mark() if self.metrics is not None else None
        with self._lock:
            self._uploads[uuid] = self._pool.submit(
                self._upload, staged, metadata, location, uuid, reported
            )
        return uuid

    def _upload(
        self,
        staged: Path,
        metadata: dict[str, Any],
        location: Location,
        uuid: str,
        reported: int | None = None,
    ) -> None:
        try:
            seal(staged, metadata)
            upload_dir(self.s3, staged, location, last=METADATA_FILE)
            metadata = read_json(staged / METADATA_FILE)
            record = {
                "uuid": uuid,
                "uri": self.uri(uuid),
                "s3_uri": location.uri,
                "steps_completed": metadata.get("steps_completed"),
                "validation_metrics": metadata.get("validation_metrics"),
                "bytes": sum(f["size"] for f in (metadata.get("files") or {}).values()),
            }
            if self.metrics is not None and reported is not None:
                # Its metrics first: lost with this host after the record, they would be
                # lost for good (whoever resumes from it never reports them again).
                self.metrics.wait_sent(reported, METRICS_BEFORE_RECORD_S)
            if self.lease is not None and not self.lease.held():  # checked last, as it writes
                log.warning(
                    "checkpoint %s of run %s not recorded: the run is now %s's; its files "
                    "are removed", uuid, self.run_id, self.lease.lost_to,
                )  # fmt: skip
                self._remove(staged, location)
                return
            record_checkpoint(self.client, self.run_id, record)
            if self.lease is not None:
                self.lease.recorded(int(record["steps_completed"] or 0))
        except Exception:
            with contextlib.suppress(Exception):  # the upload's own error is the one to raise
                self._remove(staged, location)
            raise

    def _remove(self, staged: Path, location: Location) -> None:
        """A checkpoint that is not recorded: its uploaded files and its local copy."""
        try:
            delete_prefix(self.s3, location)
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def completed_uploads(self, wait: bool = False) -> list[str]:
        """Uploads finished since the last call (raising the first failure)."""
        with self._lock:
            items = list(self._uploads.items())
        done = []
        for uuid, future in items:
            if uuid in self._reported or not (wait or future.done()):
                continue
            error = future.exception()
            self._reported.add(uuid)
            if error is not None:
                raise CheckpointError(f"uploading checkpoint {uuid} failed: {error}") from error
            done.append(uuid)
        return done

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    @contextlib.contextmanager
    def restore(self, uuid: str) -> Iterator[Path]:
        future = self._uploads.get(uuid)
        if future is not None:
            future.result()
        local = self._local_copy(uuid)
        if (local / METADATA_FILE).is_file():
            verify(local)
            yield local
            return
        yield fetch_checkpoint(self.s3, self.location(uuid), self.cache_dir)

    def delete(self, uuid: str) -> None:
        location = self.location(uuid)
        delete_prefix(self.s3, location)
        shutil.rmtree(self._local_copy(uuid), ignore_errors=True)
        forget_checkpoint_record(self.client, self.run_id, uuid, location.uri)

    def uri(self, uuid: str) -> str:
        return f"runs:/{self.run_id}/checkpoints/{uuid}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
