"""S3 access for checkpoint bytes: multipart uploads, safe downloads, idempotent deletes,
and errors that name the bucket, the endpoint and what to check.

Every function also takes a ``FileLocation`` (a ``file://`` directory: MLflow's local
artifact root in the no-server embedded mode) and then works on the filesystem."""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from det_tasks.errors import CheckpointError
from registry.servers.containment import Boundary, fully_decoded, key_within, normalised_key
from registry.servers.local_files import FileLocation

__all__ = [
    "FileLocation",
    "LazyClient",
    "Location",
    "RUN_ARTIFACTS_EXAMPLE",
    "S3Location",
    "artifact_location",
    "client",
    "delete_prefix",
    "download_prefix",
    "explain",
    "object_exists",
    "parse_location",
    "parse_s3_uri",
    "put_object",
    "read_object",
    "upload_dir",
    "upload_file",
]

TRANSFER = TransferConfig(
    multipart_threshold=16 * 2**20,
    multipart_chunksize=16 * 2**20,
    max_concurrency=8,
    use_threads=True,
)


class S3Location:
    """The objects under ``prefix`` in ``bucket``, which must stay under ``root`` there.

    ``prefix`` is kept normalised (``a/b/../c`` is ``a/c``); ``given`` is the text it came
    from, for messages."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        root: str = "",
        boundary: Boundary | None = None,
        given: str | None = None,
    ) -> None:
        self.bucket = bucket
        self.given = given if given is not None else f"s3://{bucket}/{prefix.lstrip('/')}"
        self.prefix = normalised_key(prefix)
        self.root = normalised_key(root)
        self.boundary = boundary or Boundary(
            f"the bucket {bucket!r}", f"s3://{bucket}", f"s3://{bucket}/<prefix>/<checkpoint>"
        )
        # Judged decoded too: a gateway or filer that decodes keys would see %2e%2e as "..".
        self._decoded_prefix = normalised_key(fully_decoded(prefix))

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def child(self, relative: str) -> S3Location:
        """``relative`` below this prefix; an absolute one (``/x``) counts from the bucket."""
        prefix = relative if relative.startswith("/") else self.key(relative.strip("/"))
        given = f"{self.given.rstrip('/')}/{relative}"
        return S3Location(self.bucket, prefix, self.root, self.boundary, given)

    def bounded(self, boundary: Boundary) -> S3Location:
        """This location as the boundary of everything derived from it."""
        return S3Location(self.bucket, self.prefix, self.prefix, boundary, self.given)

    def escape(self) -> str | None:
        for key in (self.prefix, self._decoded_prefix):
            if not key_within(key, self.root):
                return f"it normalises to s3://{self.bucket}/{key}"
        return None


Location = S3Location | FileLocation


RUN_ARTIFACTS_EXAMPLE = "runs:/<run_id>/checkpoints/<uuid>"


def parse_location(uri: str) -> Location:
    """``s3://bucket/prefix`` or ``file:///abs/path`` (percent-encoding decoded, as in any
    file URI)."""
    if uri.startswith("file:"):
        path = uri.removeprefix("file://") if uri.startswith("file://") else uri[5:]
        if not path.startswith("/"):
            raise CheckpointError(f"{uri!r} is not an absolute file:// URI (file:///abs/path)")
        return FileLocation(urllib.parse.unquote(path), given=uri)
    return parse_s3_uri(uri)


def artifact_location(artifact_uri: str, artifacts_destination: str | None, what: str) -> Location:
    """Where the bytes of an MLflow artifact URI live.

    With a proxying MLflow server the artifact URI is ``mlflow-artifacts:/<path>``; its bytes
    are at ``<artifacts destination>/<path>``, which boto3 writes directly (FACTS: proxied
    uploads are ~6x slower) while the MLflow UI still lists them among the run's artifacts.
    The location is the boundary of every path derived from it (``ensure_contained``).
    """
    base = _artifact_base(artifact_uri, artifacts_destination, what)
    return base.bounded(Boundary("the run's artifact root", base.uri, RUN_ARTIFACTS_EXAMPLE))


def _artifact_base(artifact_uri: str, artifacts_destination: str | None, what: str) -> Location:
    if artifact_uri.startswith(("s3://", "file:")):
        return parse_location(artifact_uri)
    if artifact_uri.startswith("/"):
        return FileLocation(artifact_uri)
    if artifact_uri.startswith("mlflow-artifacts:"):
        if not artifacts_destination:
            raise CheckpointError(
                f"{what}: the MLflow server proxies artifacts; set DET_TASKS_MLFLOW_ARTIFACTS "
                "to its --artifacts-destination (s3://bucket/prefix)"
            )
        path = artifact_uri.split(":", 1)[1].lstrip("/")
        return parse_location(f"{artifacts_destination.rstrip('/')}/{path}")
    raise CheckpointError(
        f"{what}: artifacts at {artifact_uri!r} are neither in S3 nor in a local directory; "
        "start the MLflow server with an s3:// artifact destination"
    )


def parse_s3_uri(uri: str) -> S3Location:
    if not uri.startswith("s3://"):
        raise CheckpointError(f"{uri!r} is not an s3:// URI")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise CheckpointError(f"{uri!r} names no bucket")
    return S3Location(bucket, prefix, given=uri)


def client(endpoint_url: str | None = None) -> Any:
    endpoint = (
        endpoint_url
        or os.environ.get("MLFLOW_S3_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    # A fresh session reads the credentials now (the default session caches the first ones).
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        config=botocore.config.Config(
            retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60
        ),
    )


class LazyClient:
    """``client(endpoint_url)``, built at its first use: an experiment whose checkpoints
    are all local files (the no-server mode) never pays boto3's set-up (~0.5 s of its
    end)."""

    def __init__(self, endpoint_url: str | None = None) -> None:
        self._endpoint_url = endpoint_url
        self._client: Any = None
        # A checkpoint's first upload uses it from several threads at once: one builds it.
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (a copy or unpickling): not the client's
            raise AttributeError(name)
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = client(self._endpoint_url)
        return getattr(self._client, name)


def explain(err: Exception, where: str) -> CheckpointError:
    """A boto error as a message that says what to check."""
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or "AWS S3"
    if isinstance(err, botocore.exceptions.ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        hints = {
            "InvalidAccessKeyId": "the access key is unknown: check AWS_ACCESS_KEY_ID",
            "SignatureDoesNotMatch": "the secret key is wrong: check AWS_SECRET_ACCESS_KEY",
            "NoSuchBucket": "the bucket does not exist: create it or fix the bucket name",
            "AccessDenied": "the credentials may not access it: check the key's permissions",
            "404": "nothing is stored there: check the URI",
            "NoSuchKey": "nothing is stored there: check the URI",
        }
        hint = hints.get(code, err.response.get("Error", {}).get("Message", code))
        return CheckpointError(f"S3 request for {where} at {endpoint} failed ({code}): {hint}")
    if isinstance(err, botocore.exceptions.EndpointConnectionError):
        return CheckpointError(
            f"S3 endpoint {endpoint} is unreachable for {where}: is the object store up "
            "(make up) and MLFLOW_S3_ENDPOINT_URL right?"
        )
    if isinstance(err, botocore.exceptions.NoCredentialsError):
        return CheckpointError(
            f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(source .stack/env for the local stack)"
        )
    return CheckpointError(f"S3 request for {where} at {endpoint} failed: {err}")


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield path


def upload_dir(s3: Any, local: Path, location: Location, last: str | None = None) -> None:
    """Upload every file under ``local``; ``last`` (a relative name) goes after the rest, as
    a commit marker: a reader that finds it knows every other file is complete."""
    if isinstance(location, FileLocation):
        location.upload_dir(local)
        return
    files = [p for p in _files(local) if p.relative_to(local).as_posix() != last]
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(
                pool.map(
                    lambda p: s3.upload_file(
                        str(p),
                        location.bucket,
                        location.key(p.relative_to(local).as_posix()),
                        Config=TRANSFER,
                    ),
                    files,
                )
            )
        if last is not None and (local / last).exists():
            s3.upload_file(str(local / last), location.bucket, location.key(last), Config=TRANSFER)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
        raise explain(err, location.uri) from None
    except boto3.exceptions.S3UploadFailedError as err:
        cause = err.__cause__ or err.__context__ or err
        raise explain(cause if isinstance(cause, Exception) else err, location.uri) from None


def object_exists(s3: Any, location: Location) -> bool:
    """Whether an object is stored at ``location`` (its prefix is the key)."""
    if isinstance(location, FileLocation):
        return location.path.is_file()
    try:
        s3.head_object(Bucket=location.bucket, Key=location.prefix)
        return True
    except botocore.exceptions.ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise explain(err, location.uri) from None


def list_keys(s3: Any, location: S3Location) -> list[str]:
    keys: list[str] = []
    prefix = location.prefix + "/" if location.prefix else ""
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=prefix
        ):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
        raise explain(err, location.uri) from None
    return keys


def safe_relative(key: str, prefix: str) -> str:
    """The key below ``prefix``, refusing absolute paths and ``..`` (path traversal)."""
    rel = key[len(prefix) :].lstrip("/") if prefix else key
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or any(p in ("..", "") for p in parts) or "\\" in rel:
        raise CheckpointError(
            f"refusing checkpoint object {key!r}: its path escapes the checkpoint"
        )
    return rel


def read_object(s3: Any, location: Location, relative: str) -> bytes | None:
    """The bytes of the object ``relative`` under ``location``, or None if there is none."""
    if isinstance(location, FileLocation):
        return location.read(relative)
    try:
        return bytes(
            s3.get_object(Bucket=location.bucket, Key=location.key(relative))["Body"].read()
        )
    except botocore.exceptions.ClientError as err:
        if err.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404"):
            return None
        raise explain(err, location.uri) from None
    except botocore.exceptions.BotoCoreError as err:
        raise explain(err, location.uri) from None


def put_object(s3: Any, location: Location, data: bytes) -> None:
    """Store ``data`` as the single object at ``location``."""
    if isinstance(location, FileLocation):
        location.write(data)
        return
    try:
        s3.put_object(Bucket=location.bucket, Key=location.prefix, Body=data)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
        raise explain(err, location.uri) from None


def upload_file(s3: Any, path: Path, location: Location) -> None:
    """Store the local file ``path`` as the single object at ``location`` (streamed, one
    object: it exists complete or not at all)."""
    if isinstance(location, FileLocation):
        location.write(path.read_bytes())
        return
    try:
        s3.upload_file(str(path), location.bucket, location.prefix, Config=TRANSFER)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
        raise explain(err, location.uri) from None
    except boto3.exceptions.S3UploadFailedError as err:
        cause = err.__cause__ or err.__context__ or err
        raise explain(cause if isinstance(cause, Exception) else err, location.uri) from None


def download_prefix(s3: Any, location: Location, dest: Path) -> list[str]:
    """Download every object under the prefix into ``dest``; returns the relative names."""
    if isinstance(location, FileLocation):
        return location.download(dest)
    keys = list_keys(s3, location)
    if not keys:
        raise CheckpointError(f"nothing is stored at {location.uri}: check the URI")
    names = []
    for key in keys:
        rel = safe_relative(key, location.prefix)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            s3.download_file(location.bucket, key, str(target), Config=TRANSFER)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise explain(err, f"s3://{location.bucket}/{key}") from None
        names.append(rel)
    return names


def delete_prefix(s3: Any, location: Location) -> int:
    """Delete everything under the prefix; a missing object is not an error."""
    if isinstance(location, FileLocation):
        return location.delete()
    keys = list_keys(s3, location)
    for start in range(0, len(keys), 1000):
        chunk = [{"Key": k} for k in keys[start : start + 1000]]
        try:
            s3.delete_objects(Bucket=location.bucket, Delete={"Objects": chunk, "Quiet": True})
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise explain(err, location.uri) from None
    return len(keys)
