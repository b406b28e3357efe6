"""The model registry: register an experiment's best checkpoint and move aliases to it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from det_tasks.errors import DetTasksError
from registry.checkpoints.store import checkpoint_records, rank_by_metric, validation_value
from registry.runs.tracking import EXPERIMENT_RUN_TAG, PARENT_TAG

__all__ = ["BestCheckpoint", "best_checkpoint", "parent_run", "register_checkpoint", "set_alias"]


@dataclasses.dataclass(frozen=True)
class BestCheckpoint:
    run_id: str
    uuid: str
    uri: str
    metric: str
    value: float
    steps_completed: int


def parent_run(client: MlflowClient, experiment: str) -> Any:
    """The experiment's parent run (its newest, if the name was reused): the run its
    trials hang under and its checkpoints are listed from."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise DetTasksError(f"MLflow has no experiment named {experiment!r}")
    parents = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` != ''",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not parents:
        raise DetTasksError(f"experiment {experiment!r} has no experiment run yet")
    return parents[0]


def trial_runs(client: MlflowClient, parent: Any) -> list[Any]:
    return list(
        client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        )
    )


def best_checkpoint(client: MlflowClient, experiment: str) -> BestCheckpoint:
    """The checkpoint with the best searcher metric across the latest experiment run."""
    parent = parent_run(client, experiment)
    metric = parent.data.tags.get("det.searcher.metric")
    smaller = parent.data.tags.get("det.searcher.smaller_is_better", "True") == "True"
    if not metric:
        raise DetTasksError(f"experiment {experiment!r} records no searcher metric")
    records = [
        {**record, "run_id": run.info.run_id}
        for run in trial_runs(client, parent)
        for record in checkpoint_records(client, run.info.run_id)
    ]
    ranked = rank_by_metric(records, metric, smaller)
    if not ranked:
        raise DetTasksError(
            f"experiment {experiment!r} has no checkpoint with a validation of {metric!r}"
        )
    best = ranked[0]
    value = validation_value(best, metric)
    assert value is not None
    return BestCheckpoint(
        best["run_id"], best["uuid"], best["uri"], metric, value, int(best["steps_completed"])
    )


def register_checkpoint(
    client: MlflowClient, name: str, best: BestCheckpoint, alias: str | None = None
) -> str:
    """Register ``best`` as a new version of model ``name``; returns the version number."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="det-tasks PyTorchTrial checkpoints")
    version = client.create_model_version(
        name,
        source=best.uri,
        run_id=best.run_id,
        tags={
            "det.checkpoint_uuid": best.uuid,
            "det.metric": json.dumps({best.metric: best.value}),
            "det.steps_completed": str(best.steps_completed),
        },
    )
    if alias:
        set_alias(client, name, alias, str(version.version))
    return str(version.version)


def set_alias(client: MlflowClient, name: str, alias: str, version: str) -> None:
    client.set_registered_model_alias(name, alias, version)
