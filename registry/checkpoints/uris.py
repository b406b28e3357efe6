"""Checkpoint URIs for ``load_trial_from_checkpoint_path``: ``s3://bucket/prefix``,
``runs:/<run_id>/<path>``, ``models:/<name>/<version>`` and ``models:/<name>@<alias>``.

Registered with det_tasks through the ``det_tasks.checkpoint_resolvers`` entry points, so
det_tasks resolves them without importing MLflow or boto3.
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mlflow.exceptions import MlflowException

from det_tasks.errors import CheckpointError
from registry.checkpoints.cache import fetch_checkpoint
from registry.runs.tracking import client_for
from registry.servers import s3 as s3_lib
from registry.servers.containment import Boundary, fully_decoded
from registry.servers.settings import RegistrySettings

__all__ = [
    "checkpoint_location",
    "fetch_checkpoint_uri",
    "models_uri_source",
    "resolve_models",
    "resolve_runs",
    "resolve_s3",
]


def _settings() -> RegistrySettings:
    return RegistrySettings.from_env()


def checkpoint_location(uri: str) -> s3_lib.Location:
    """Where the bytes behind any supported URI live, bounded by what the URI names: a run's
    artifact root (runs:/, models:/), the configured prefix it starts in, or its bucket."""
    if uri.startswith(("s3://", "file:")):
        return _bounded_by_settings(uri) or s3_lib.parse_location(uri)
    if uri.startswith("runs:/"):
        return _runs_location(uri)
    if uri.startswith("models:/"):
        return checkpoint_location(models_uri_source(uri))
    raise CheckpointError(f"{uri!r}: unsupported checkpoint URI scheme")


def _client():  # type: ignore[no-untyped-def]
    settings = _settings()
    if not settings.tracking_uri:
        raise CheckpointError(
            "MLFLOW_TRACKING_URI is not set: runs:/ and models:/ URIs need the MLflow server "
            "(source .stack/env after `make up`)"
        )
    _probe(settings.tracking_uri)
    return client_for(settings.tracking_uri)


def _probe(tracking_uri: str) -> None:
    """Fail in seconds, not after MLflow's minutes of retries, when the server is down."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=5):
            return
    except urllib.error.HTTPError:
        return  # it answered: reachable (a proxy may not serve /health)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"MLflow at {tracking_uri} is unreachable ({type(err).__name__}): is the server "
            "up (make up) and MLFLOW_TRACKING_URI right?"
        ) from None


def _bounded_by_settings(uri: str) -> s3_lib.Location | None:
    """``uri`` as a location bounded by the configured prefix (DET_TASKS_MLFLOW_ARTIFACTS,
    DET_TASKS_ARTIFACT_ROOT) it is written under, or None when it is under neither."""
    settings = _settings()
    configured = [("DET_TASKS_MLFLOW_ARTIFACTS", settings.artifacts_destination)]
    if settings.artifact_root:
        configured.append(("DET_TASKS_ARTIFACT_ROOT", Path(settings.artifact_root).as_uri()))
    for name, prefix in configured:
        if not prefix:
            continue
        head = prefix.rstrip("/") + "/"
        written = uri if uri.startswith(head) else fully_decoded(uri)
        if written.startswith(head):
            root = s3_lib.parse_location(prefix.rstrip("/"))
            edge = Boundary(
                f"the configured prefix {name}", root.uri, f"{head}<path to the checkpoint>"
            )
            return root.bounded(edge).child(written[len(head) :])
    return None


def _runs_location(uri: str) -> s3_lib.Location:
    rest = uri[len("runs:/") :].lstrip("/")
    run_id, _, raw_path = rest.partition("/")
    path = fully_decoded(raw_path).rstrip("/")  # decoded first: %2e%2e is ".."
    if not run_id or not path.strip("/"):
        raise CheckpointError(f"{uri!r} is not of the form {s3_lib.RUN_ARTIFACTS_EXAMPLE}")
    client = _client()
    try:
        artifact_uri = client.get_run(run_id).info.artifact_uri
    except MlflowException as err:
        raise CheckpointError(
            f"{uri!r}: MLflow at {_settings().tracking_uri} has no run {run_id!r} "
            f"({err.error_code})"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{uri!r}: MLflow at {_settings().tracking_uri} is unreachable ({type(err).__name__});"
            " is the server up?"
        ) from None
    base = s3_lib.artifact_location(artifact_uri, _settings().artifacts_destination, repr(uri))
    return base.child(path)  # a path starting with "/" is absolute, and leaves the run's root


def models_uri_source(uri: str) -> str:
    """The source URI behind ``models:/name/version`` or ``models:/name@alias``."""
    rest = uri[len("models:/") :].strip("/")
    client = _client()
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = rest.partition("/")
            if not number:
                raise CheckpointError(
                    f"{uri!r} needs a version or alias: models:/name/1 or models:/name@champion"
                )
            version = client.get_model_version(name, number)
    except MlflowException as err:
        raise CheckpointError(
            f"{uri!r}: MLflow at {_settings().tracking_uri} has no such model version "
            f"({err.error_code}); list them with `det-tasks models list`"
        ) from None
    return str(version.source)


def fetch_checkpoint_uri(uri: str) -> Path:
    """A verified local copy of the checkpoint ``uri`` names (fetched once: ``cache``)."""
    location = checkpoint_location(uri)
    client = s3_lib.client(_settings().s3_endpoint)
    return fetch_checkpoint(client, location, _settings().cache_dir, reference=uri)


@contextlib.contextmanager
def resolve_s3(uri: str) -> Iterator[Path]:
    yield fetch_checkpoint_uri(uri)


@contextlib.contextmanager
def resolve_runs(uri: str) -> Iterator[Path]:
    yield fetch_checkpoint_uri(uri)


@contextlib.contextmanager
def resolve_models(uri: str) -> Iterator[Path]:
    yield fetch_checkpoint_uri(uri)
