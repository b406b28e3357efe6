"""Model-directory packages in S3, addressed by content: ``s3://BUCKET/packages/<sha256>.tar.gz``.

The submitting laptop uploads a package once per distinct content; a worker on any machine
needs only the URI (and S3 credentials from its own environment) to get a fresh copy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import botocore.exceptions

from det_tasks.checkpoints.model_package import PackedModel, unpack_model_package
from det_tasks.errors import DetTasksError
from registry.servers import s3 as s3_lib
from registry.servers.settings import RegistrySettings

__all__ = ["PACKAGE_PREFIX", "download_package", "fetch_package", "upload_package"]

PACKAGE_PREFIX = "packages"


def _bucket(settings: RegistrySettings) -> str:
    if not settings.bucket:
        raise DetTasksError(
            "DET_TASKS_S3_BUCKET is not set: say which bucket holds model packages "
            "(after `make up`: source .stack/env)"
        )
    return settings.bucket


def upload_package(
    packed: PackedModel, settings: RegistrySettings | None = None
) -> tuple[str, bool]:
    """Upload ``packed`` unless that content is already there; returns (URI, uploaded)."""
    settings = settings or RegistrySettings.from_env()
    bucket = _bucket(settings)
    key = f"{PACKAGE_PREFIX}/{packed.sha256}.tar.gz"
    uri = f"s3://{bucket}/{key}"
    s3 = s3_lib.client(settings.s3_endpoint)
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return uri, False
    except botocore.exceptions.ClientError as err:
        if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
            raise s3_lib.explain(err, uri) from None
    except botocore.exceptions.BotoCoreError as err:
        raise DetTasksError(f"S3 at {settings.s3_endpoint} is unreachable: {err}") from None
    try:
        s3.put_object(
            Bucket=bucket,
            Key=key,
            Body=packed.data,
            Metadata={"sha256": packed.sha256, "files": str(len(packed.files))},
        )
    except botocore.exceptions.ClientError as err:
        raise s3_lib.explain(err, uri) from None
    return uri, True


def fetch_package(uri: str, parent: str | Path | None = None) -> Path:
    """Download and unpack ``uri`` into a new, empty folder; returns that folder."""
    location = s3_lib.parse_s3_uri(uri)
    settings = RegistrySettings.from_env()
    s3 = s3_lib.client(settings.s3_endpoint)
    workdir = Path(tempfile.mkdtemp(prefix="det-tasks-model-", dir=parent))
    archive = workdir / "package.tar.gz"
    try:
        s3.download_file(location.bucket, location.prefix, str(archive))
    except botocore.exceptions.ClientError as err:
        raise s3_lib.explain(err, uri) from None
    try:
        return unpack_model_package(archive, workdir / "model")
    finally:
        archive.unlink(missing_ok=True)


def download_package(uri: str, archive: str | Path) -> Path:
    """Download the package ``uri`` as it is (not unpacked) to the file ``archive``,
    which appears whole or not at all."""
    location = s3_lib.parse_s3_uri(uri)
    s3 = s3_lib.client(RegistrySettings.from_env().s3_endpoint)
    target = Path(archive)
    partial = target.with_name(f".{target.name}.partial")
    try:
        s3.download_file(location.bucket, location.prefix, str(partial))
    except botocore.exceptions.ClientError as err:
        partial.unlink(missing_ok=True)
        raise s3_lib.explain(err, uri) from None
    partial.replace(target)
    return target
