"""Checkpoint retention for one trial: keep the latest N and the best M, delete the rest.

The config fields are Determined's ``save_trial_latest`` and ``save_trial_best``; ranking
uses the searcher metric recorded with each checkpoint's validation.
"""

from __future__ import annotations

from typing import Any

from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.sinks import ReportedCheckpoint

__all__ = ["checkpoints_to_keep", "collect_garbage"]


def checkpoints_to_keep(
    checkpoints: list[ReportedCheckpoint],
    keep_latest: int,
    keep_best: int,
    metric: str | None,
    smaller_is_better: bool,
) -> set[str]:
    """The uuids the policy retains (the latest one is always kept, to resume from)."""
    ordered = sorted(checkpoints, key=lambda c: c.steps_completed)
    keep = {c.uuid for c in ordered[-max(keep_latest, 1) :]} if ordered else set()
    if metric and keep_best:
        scored = [(c, _metric(c.metadata, metric)) for c in ordered]
        ranked = sorted(
            ((c, v) for c, v in scored if v is not None),
            key=lambda cv: cv[1] if smaller_is_better else -cv[1],  # type: ignore[operator]
        )
        keep |= {c.uuid for c, _ in ranked[:keep_best]}
    return keep


def _metric(metadata: dict[str, Any], metric: str) -> float | None:
    value = (metadata.get("validation_metrics") or {}).get(metric)
    return float(value) if isinstance(value, int | float) else None


def collect_garbage(
    store: CheckpointStore,
    checkpoints: list[ReportedCheckpoint],
    keep_latest: int,
    keep_best: int,
    metric: str | None,
    smaller_is_better: bool,
) -> list[str]:
    """Delete checkpoints outside the policy; returns the deleted uuids."""
    keep = checkpoints_to_keep(checkpoints, keep_latest, keep_best, metric, smaller_is_better)
    deleted = [c.uuid for c in checkpoints if c.uuid not in keep]
    for uuid in deleted:
        store.delete(uuid)
    return deleted
