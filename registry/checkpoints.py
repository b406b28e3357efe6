"""The S3 checkpoint store: bytes in S3 under the trial run's artifacts, a record in MLflow.

``publish`` returns at once; the upload runs on a background thread (the training thread
only paid for writing the state to local disk). ``metadata.json`` is uploaded last, as the
commit marker, and only then is the checkpoint recorded on the run (a ``det.checkpoint.*``
tag with its step and validation metrics), so a reader never finds a half-uploaded one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import uuid as uuid_lib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.checkpoint_format import METADATA_FILE, read_json, seal
from det_tasks.errors import CheckpointError
from registry.cache import fetch_checkpoint
from registry.s3 import Location, artifact_location, delete_prefix, upload_dir

__all__ = [
    "CHECKPOINT_TAG",
    "S3CheckpointStore",
    "checkpoint_records",
    "rank_by_metric",
    "run_checkpoint_location",
    "validation_value",
]

CHECKPOINT_TAG = "det.checkpoint."


def run_checkpoint_location(
    client: MlflowClient, run_id: str, artifacts_destination: str | None, uuid: str
) -> Location:
    """Where a checkpoint's bytes go: ``checkpoints/<uuid>`` under the run's artifact root
    (an S3 prefix, or a local directory in the embedded mode)."""
    artifact_uri = client.get_run(run_id).info.artifact_uri
    base = artifact_location(artifact_uri, artifacts_destination, f"run {run_id}")
    return base.child(f"checkpoints/{uuid}")


def validation_value(record: dict[str, Any], metric: str) -> float | None:
    """The checkpoint's validation value of ``metric``, if it was validated with one."""
    value = (record.get("validation_metrics") or {}).get(metric)
    return float(value) if isinstance(value, int | float) else None


def rank_by_metric(
    records: list[dict[str, Any]], metric: str, smaller_is_better: bool
) -> list[dict[str, Any]]:
    """The records that carry ``metric``, best first (the searcher's ordering rule, for the
    best-checkpoint lookup, experiment views and GC alike)."""
    sign = 1.0 if smaller_is_better else -1.0
    scored = [(value, r) for r in records if (value := validation_value(r, metric)) is not None]
    return [r for _, r in sorted(scored, key=lambda s: sign * s[0])]


def checkpoint_records(client: MlflowClient, run_id: str) -> list[dict[str, Any]]:
    """Every checkpoint recorded on a run, oldest first."""
    tags = client.get_run(run_id).data.tags
    records = [json.loads(v) for k, v in tags.items() if k.startswith(CHECKPOINT_TAG)]
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
    ) -> None:
        self.client = client
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
        staging = self.cache_dir / "staging"
        staging.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="ckpt-", dir=staging))

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        """Returns at once: checksums and upload run on the upload thread."""
        uuid = str(uuid_lib.uuid4())
        location = self.location(uuid)
        with self._lock:
            self._uploads[uuid] = self._pool.submit(self._upload, staged, metadata, location, uuid)
        return uuid

    def _upload(
        self, staged: Path, metadata: dict[str, Any], location: Location, uuid: str
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
            self.client.set_tag(self.run_id, f"{CHECKPOINT_TAG}{uuid}", json.dumps(record))
        except Exception:
            with contextlib.suppress(Exception):
                delete_prefix(self.s3, location)
            raise
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
        yield fetch_checkpoint(self.s3, self.location(uuid), self.cache_dir)

    def delete(self, uuid: str) -> None:
        delete_prefix(self.s3, self.location(uuid))
        with contextlib.suppress(Exception):
            self.client.delete_tag(self.run_id, f"{CHECKPOINT_TAG}{uuid}")

    def uri(self, uuid: str) -> str:
        return f"runs:/{self.run_id}/checkpoints/{uuid}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
