"""An experiment's MLflow experiment: found, restored or made, and tagged as ours, through
MLflow's client or its REST API (registry.runs.mlflow_rest.MlflowRestClient, the same calls):
``det experiment create`` makes it without importing MLflow (about 1 s)."""

from __future__ import annotations

import time
from typing import Any

from det_tasks.errors import ConfigError
from det_tasks.folder_names import folder_name, folder_under
from registry.runs.trials_view import TRIALS_VIEW_KEY, TRIALS_VIEW_TAG, trials_view_tag
from registry.servers.containment import key_within, normalised_key
from registry.servers.mlflow_errors import refused_by_mlflow
from registry.servers.settings import RegistrySettings

__all__ = [
    "DESCRIPTION_TAG",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "ensure_experiment",
    "experiment_artifact_location",
    "mlflow_link",
    "report_link",
]

# Ours are model-training experiments, whose page is the runs table. MLflow UIs before the
# GenAI / "Model training" switch chose an experiment's pages by this tag; 3.17.2's ignores
# it and follows the switch (the URL's ``workflowType``, else the browser's choice, else
# GenAI): docs/concepts/tracking.md says what a user clicks.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
DESCRIPTION_TAG = "mlflow.note.content"  # the experiment's description in the MLflow UI
# MLflow 3's MAX_EXPERIMENT_TAG_VAL_LENGTH: a longer description is refused, not cut.
_EXPERIMENT_TAG_LIMIT = 20_000


def ensure_experiment(client: Any, name: str, description: str | None = None) -> str:
    """The id of MLflow experiment ``name``, created (or restored) if needed, tagged as a
    model-training experiment and carrying ``description``. ``client``: MLflow's, or
    registry.runs.mlflow_rest.MlflowRestClient."""
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    default_view = {
        TRIALS_VIEW_TAG: trials_view_tag(None, True, [], set(), int(time.time() * 1000))
    }
    if description:
        tags[DESCRIPTION_TAG] = _shown_description(description)
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        _tag_experiment(client, found, tags)
        if TRIALS_VIEW_TAG not in found.tags:  # the link opens it: it must exist
            _tag_experiment(client, found, default_view)
        return str(found.experiment_id)
    root = RegistrySettings.from_env().artifact_root
    location = experiment_artifact_location(root, name) if root else None
    try:
        return str(
            client.create_experiment(
                name, artifact_location=location, tags={**tags, **default_view}
            )
        )
    except Exception as err:  # created concurrently by another trial
        if not refused_by_mlflow(err):
            raise
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        _tag_experiment(client, found, tags)
        return str(found.experiment_id)


def experiment_artifact_location(root: str, name: str) -> str:
    """Where a new experiment ``name`` keeps its artifacts under ``root`` (a folder, or an
    ``s3://bucket/prefix``): one folder named by ``det_tasks.folder_names`` (the name's
    safe characters and a hash), so no name reaches outside ``root``."""
    if root.startswith("s3://"):
        prefix = root.rstrip("/")
        location = f"{prefix}/{folder_name(name)}"
        bucket_and_key = location[len("s3://") :]
        bucket_and_prefix = prefix[len("s3://") :]
        if not key_within(normalised_key(bucket_and_key), normalised_key(bucket_and_prefix)):
            raise ConfigError(f"experiment {name!r}: {location} is outside {root}")
        return location
    if "://" in root:
        raise ConfigError(
            f"DET_TASKS_ARTIFACT_ROOT={root!r}: give a folder or an s3://bucket/prefix"
        )
    return folder_under(root, name).as_uri()


def _shown_description(description: str) -> str:
    """The description MLflow's UI shows (an experiment tag holds at most 20,000
    characters; the whole text stays in each run's config)."""
    if len(description) <= _EXPERIMENT_TAG_LIMIT:
        return description
    cut = " ... (cut here: the whole description is in the runs' det.config tag)"
    return description[: _EXPERIMENT_TAG_LIMIT - len(cut)] + cut


def _tag_experiment(client: Any, experiment: Any, tags: dict[str, str]) -> None:
    """Experiments made before the tags existed (or by hand) get them on next use."""
    for key, value in tags.items():
        if experiment.tags.get(key) != value:
            client.set_experiment_tag(experiment.experiment_id, key, value)


def mlflow_link(tracking_uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI page of an experiment's trials (or of one run); for a local store,
    that page in the command that serves one.

    ``workflowType=machine_learning`` matters: a browser that never chose MLflow 3.17's
    "Model training" workspace opens even a tagged experiment's bare link in the GenAI
    Overview (seen in headless Chromium); the parameter selects the "Model training" one.
    The experiment's link opens its saved view (``viewStateShareKey``): every trial, best
    first, with the searcher metric and hyperparameters as columns.
    """
    if run_id:
        page = f"experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    else:
        page = (
            f"experiments/{experiment_id}/runs?viewStateShareKey={TRIALS_VIEW_KEY}"
            "&workflowType=machine_learning"
        )
    return _ui_page(tracking_uri, page)


def report_link(tracking_uri: str, experiment_id: str, run_id: str, path: str) -> str:
    """An artifact in MLflow's artifact viewer (an HTML page renders there; the plain
    artifact URL would download it)."""
    page = f"experiments/{experiment_id}/runs/{run_id}/artifacts/{path}"
    return _ui_page(tracking_uri, page + "?workflowType=machine_learning")


def _ui_page(tracking_uri: str, page: str) -> str:
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/{page}"
    return f"#/{page} in `mlflow ui --backend-store-uri {tracking_uri}`"
