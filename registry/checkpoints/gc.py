"""Checkpoint garbage collection for an experiment run, per its checkpoint_storage policy.

Keeps each trial's latest ``save_trial_latest`` and best ``save_trial_best`` checkpoints and
the experiment's best ``save_experiment_best``, never a checkpoint behind a registered model
version; deletes the rest (S3 bytes, then the MLflow record). Deleting twice is harmless.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.checkpoints.retention import checkpoints_to_keep
from det_tasks.sinks import ReportedCheckpoint
from registry.checkpoints.store import checkpoint_records, forget_checkpoint_record, rank_by_metric
from registry.runs.tracking import experiment_config
from registry.servers.s3 import delete_prefix, parse_location

__all__ = ["GcResult", "collect_experiment_garbage", "collect_trial_garbage", "registered_uuids"]


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


@dataclasses.dataclass(frozen=True)
class _Policy:
    """The experiment's ``checkpoint_storage`` retention and its searcher metric."""

    keep_latest: int
    keep_best: int
    keep_experiment_best: int
    metric: str | None
    smaller_is_better: bool

    @classmethod
    def of(cls, parent_run: Any) -> _Policy:
        config = experiment_config(parent_run.data.tags)
        storage = config.get("checkpoint_storage") or {}
        searcher = config.get("searcher") or {}
        return cls(
            keep_latest=int(storage.get("save_trial_latest", 1)),
            keep_best=int(storage.get("save_trial_best", 1)),
            keep_experiment_best=int(storage.get("save_experiment_best", 0)),
            metric=searcher.get("metric"),
            smaller_is_better=bool(searcher.get("smaller_is_better", True)),
        )

    def trial_keeps(self, records: list[dict[str, Any]]) -> set[str]:
        """One trial's latest ``save_trial_latest`` and best ``save_trial_best``."""
        reported = [
            ReportedCheckpoint(
                r["steps_completed"], r["uuid"], {"validation_metrics": r.get("validation_metrics")}
            )
            for r in records
        ]
        return checkpoints_to_keep(
            reported, self.keep_latest, self.keep_best, self.metric, self.smaller_is_better
        )

    def best_of(self, records: list[dict[str, Any]]) -> set[str]:
        """The ``save_experiment_best`` best of ``records``."""
        if not self.metric or not self.keep_experiment_best:
            return set()
        ranked = rank_by_metric(records, self.metric, self.smaller_is_better)
        return {r["uuid"] for r in ranked[: self.keep_experiment_best]}


def collect_experiment_garbage(
    client: MlflowClient, s3: Any, parent_run: Any, trial_runs: list[Any]
) -> GcResult:
    """The whole experiment, by policy (its end, ``det-tasks gc``): reads every trial run."""
    policy = _Policy.of(parent_run)
    records: dict[str, tuple[str, dict[str, Any]]] = {}
    keep: set[str] = set()
    for run in trial_runs:
        run_records = checkpoint_records(client, run.info.run_id)
        for r in run_records:
            records[r["uuid"]] = (run.info.run_id, r)
        keep |= policy.trial_keeps(run_records)
    keep |= policy.best_of([r for _, r in records.values()])
    protected = registered_uuids(client, [r.info.run_id for r in trial_runs])
    return _delete_unkept(client, s3, records, keep, protected)


def collect_trial_garbage(client: MlflowClient, s3: Any, parent_run: Any, run_id: str) -> GcResult:
    """One trial at its end: only its own checkpoints are read, so a trial's end costs the
    same in an experiment of 10 trials or 1,000 (the experiment-wide pass at every trial's
    end made an experiment's bookkeeping grow with the square of its trials). The trial's
    own ``save_experiment_best`` best stay too: one of them may rank among the experiment's
    best, which only the experiment's end (``collect_experiment_garbage``) can tell.

    The model registry is asked only when a checkpoint would go: most trials keep all they
    have (one latest, one best), and the query was a fifth of a warm trial's end (17 ms of
    80 on a loaded 2-core worker). So ``protected`` is empty when nothing would go."""
    policy = _Policy.of(parent_run)
    run_records = checkpoint_records(client, run_id)
    records = {r["uuid"]: (run_id, r) for r in run_records}
    keep = policy.trial_keeps(run_records) | policy.best_of(run_records)
    protected = registered_uuids(client, [run_id]) if set(records) - keep else set()
    return _delete_unkept(client, s3, records, keep, protected)


def _delete_unkept(
    client: MlflowClient,
    s3: Any,
    records: dict[str, tuple[str, dict[str, Any]]],
    keep: set[str],
    protected: set[str],
) -> GcResult:
    """S3 bytes first, then the MLflow record, of every record neither kept nor protected."""
    deleted = []
    for uuid, (run_id, record) in records.items():
        if uuid in keep or uuid in protected:
            continue
        delete_prefix(s3, parse_location(record["s3_uri"]))
        forget_checkpoint_record(client, run_id, uuid, record["s3_uri"])
        deleted.append(uuid)
    return GcResult(sorted(keep & set(records)), sorted(deleted), sorted(protected & set(records)))
