"""Checkpoint garbage collection for an experiment run, per its checkpoint_storage policy.

Keeps each trial's latest ``save_trial_latest`` and best ``save_trial_best`` checkpoints and
the experiment's best ``save_experiment_best``, never a checkpoint behind a registered model
version; deletes the rest (S3 bytes, then the MLflow record). Deleting twice is harmless.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.gc import checkpoints_to_keep
from det_tasks.sinks import ReportedCheckpoint
from registry.checkpoints import checkpoint_records, forget_checkpoint_record, rank_by_metric
from registry.s3 import delete_prefix, parse_location

__all__ = ["GcResult", "collect_experiment_garbage", "registered_uuids"]


@dataclasses.dataclass(frozen=True)
class GcResult:
    kept: list[str]
    deleted: list[str]
    protected: list[str]


def registered_uuids(client: MlflowClient, run_ids: list[str]) -> set[str]:
    """Checkpoints that a registered model version points at."""
    found: set[str] = set()
    for run_id in run_ids:
        for version in client.search_model_versions(f"run_id = '{run_id}'"):
            uuid = (version.tags or {}).get("det.checkpoint_uuid")
            if uuid:
                found.add(uuid)
            elif version.source and "/checkpoints/" in version.source:
                found.add(version.source.rstrip("/").rsplit("/", 1)[-1])
    return found


def collect_experiment_garbage(
    client: MlflowClient, s3: Any, parent_run: Any, trial_runs: list[Any]
) -> GcResult:
    config = json.loads(parent_run.data.tags.get("det.config", "{}"))
    storage = config.get("checkpoint_storage") or {}
    keep_latest = int(storage.get("save_trial_latest", 1))
    keep_best = int(storage.get("save_trial_best", 1))
    keep_exp_best = int(storage.get("save_experiment_best", 0))
    searcher = config.get("searcher") or {}
    metric = searcher.get("metric")
    smaller = bool(searcher.get("smaller_is_better", True))

    records: dict[str, tuple[str, dict[str, Any]]] = {}
    keep: set[str] = set()
    for run in trial_runs:
        run_records = checkpoint_records(client, run.info.run_id)
        for r in run_records:
            records[r["uuid"]] = (run.info.run_id, r)
        reported = [
            ReportedCheckpoint(
                r["steps_completed"], r["uuid"], {"validation_metrics": r.get("validation_metrics")}
            )
            for r in run_records
        ]
        keep |= checkpoints_to_keep(reported, keep_latest, keep_best, metric, smaller)
    if metric and keep_exp_best:
        ranked = rank_by_metric([r for _, r in records.values()], metric, smaller)
        keep |= {r["uuid"] for r in ranked[:keep_exp_best]}
    protected = registered_uuids(client, [r.info.run_id for r in trial_runs])
    deleted = []
    for uuid, (run_id, record) in records.items():
        if uuid in keep or uuid in protected:
            continue
        delete_prefix(s3, parse_location(record["s3_uri"]))
        forget_checkpoint_record(client, run_id, uuid, record["s3_uri"])
        deleted.append(uuid)
    return GcResult(sorted(keep & set(records)), sorted(deleted), sorted(protected & set(records)))
