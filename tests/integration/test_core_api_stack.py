"""Issue 52 (first slice) on the real stack (MLflow + SeaweedFS S3): a Core API script run
by ``det-tasks run`` reports to its trial's MLflow run and stores its checkpoints in S3
with the records a PyTorchTrial's get; ``latest_checkpoint`` (a ``runs:/`` URI) resumes
it exactly. TensorBoard scalars of its reports are stored with the run."""

from __future__ import annotations

import os
import re
from pathlib import Path

from det_tasks.runner import run_trial
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "core_api"
RECORD_KEYS = {"uuid", "uri", "s3_uri", "steps_completed", "validation_metrics", "bytes"}


def _run_id(url: str | None) -> str:
    assert url is not None
    found = re.search(r"runs/([0-9a-f]{32})", url)
    assert found, url
    return found.group(1)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_core_api_script_reports_to_mlflow_and_s3_and_resumes_exactly(stack, tmp_path):
    config = EXAMPLES / "checkpoints.yaml"
    keep = "checkpoint_storage.save_trial_latest=3"  # else the run's end keeps only batch 30
    first = run_trial(
        config,
        overrides=["hyperparameters.batches=30", "hyperparameters.increment_by=2", keep],
        progress=False,
    )
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    run_id = _run_id(first.run_url)
    assert _history(client, run_id, "training/x") == [(10, 20.0), (20, 40.0), (30, 60.0)]
    assert _history(client, run_id, "validation/x") == [(30, 60.0)]
    assert [s for s, _ in _history(client, run_id, "progress/batches")] == [10, 20, 30]
    records = checkpoint_records(client, run_id)
    assert [r["steps_completed"] for r in records] == [10, 20, 30]
    for record in records:
        assert set(record) == RECORD_KEYS
        assert record["uri"] == f"runs:/{run_id}/checkpoints/{record['uuid']}"
        assert record["s3_uri"].startswith("s3://") and record["bytes"] > 0
    run = client.get_run(run_id)
    assert (run.info.status, run.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    assert first.checkpoint_uri == records[-1]["uri"]
    events = [a.path for a in client.list_artifacts(run_id, "tensorboard")]
    assert events and all(p.startswith("tensorboard/events.out.tfevents") for p in events)

    middle = records[1]["uri"]  # continue from batch 20, to 50 batches
    second = run_trial(
        config,
        overrides=["hyperparameters.batches=50", "hyperparameters.increment_by=2", keep],
        latest_checkpoint=middle,
        progress=False,
    )
    resumed = _run_id(second.run_url)
    assert _history(client, resumed, "training/x") == [(30, 60.0), (40, 80.0), (50, 100.0)]
    assert _history(client, resumed, "validation/x") == [(50, 100.0)]
    assert [r["steps_completed"] for r in checkpoint_records(client, resumed)] == [30, 40, 50]
