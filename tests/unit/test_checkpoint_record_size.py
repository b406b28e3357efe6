"""A checkpoint's record comes back whole at any size (registry.runs.large_tags): with a few
hundred validation metrics its JSON outgrows MLflow's 8,000-character tag, which cut it,
and every reader (GC, resume, the best checkpoint) then failed to parse it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from registry.checkpoints.store import (
    checkpoint_records,
    forget_checkpoint_record,
    record_checkpoint,
)


def test_a_record_with_400_metrics_comes_back_whole_and_is_forgotten(
    mlflow_store: tuple[Any, Path],
) -> None:
    client, root = mlflow_store
    experiment_id = client.create_experiment("records", artifact_location=root.as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    metrics = {f"validation_accuracy_of_class_{i:04d}": i / 400 for i in range(400)}
    small = {"uuid": "a", "steps_completed": 10, "validation_metrics": {"loss": 0.5}}
    large = {"uuid": "b", "steps_completed": 20, "validation_metrics": metrics}
    assert len(json.dumps(large)) > 8_000
    record_checkpoint(client, run_id, small)
    record_checkpoint(client, run_id, large)
    assert checkpoint_records(client, run_id) == [small, large]
    assert all(len(v) <= 8_000 for v in client.get_run(run_id).data.tags.values())
    forget_checkpoint_record(client, run_id, "b", "s3://bucket/b")
    assert checkpoint_records(client, run_id) == [small]
