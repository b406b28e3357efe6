"""``checkpoint_storage.type: s3``: checkpoints in S3, which needs the platform. With
``MLFLOW_TRACKING_URI`` set they are artifacts of the trial's MLflow run, uploaded by
``registry.checkpoints.store.S3CheckpointStore`` (det_tasks imports no boto3); the bucket and its
credentials come from the platform's settings, so ``bucket``, ``prefix``, ``endpoint_url``,
``access_key`` and ``secret_key`` are accepted for Determined's configs and have no effect.
Without the platform a trial refuses the type before its first batch: there is no local S3
store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from det_tasks.checkpoints.backends import StorageBackend, StorageOptions

__all__ = ["BACKEND", "S3Storage"]


class S3Storage(StorageOptions):
    type: Literal["s3"]
    bucket: str = Field(min_length=3)
    prefix: str | None = None
    endpoint_url: str | None = None
    access_key: str | None = None
    secret_key: str | None = None


BACKEND = StorageBackend(options=S3Storage)
