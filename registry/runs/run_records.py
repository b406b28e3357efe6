"""What the platform writes on MLflow runs, read back without importing MLflow: the tag
names, checkpoint records (large tags included), their ranking, and whether a RUNNING
experiment run has lost its flow.

``det``'s listings read runs through registry.runs.mlflow_rest and need only these; every other
registry module imports MLflow (1-4 s) at its top. The writers' modules (tracking,
large_tags, checkpoints, run_states) still hold their own definitions of the same;
tests/unit/test_det_rest.py pins that they agree until they import them from here.
"""

from __future__ import annotations

import base64
import json
import socket
import time
import zlib
from typing import Any

__all__ = [
    "CHECKPOINT_TAG",
    "EXPERIMENT_RUN_TAG",
    "FLOW_PROCESS_TAG",
    "HEARTBEAT_TAG",
    "ORPHAN_AFTER_S",
    "PACKED",
    "LargeTagError",
    "PARENT_TAG",
    "QUEUE_REASON_TAG",
    "STATE_TAG",
    "TRIAL_TAG",
    "checkpoint_records_of",
    "load_large_tag",
    "load_large_tags",
    "orphaned",
    "rank_by_metric",
    "validation_value",
]

TRIAL_TAG = "det.trial_id"  # registry.runs.tracking
EXPERIMENT_RUN_TAG = "det.experiment_run"  # registry.runs.tracking
STATE_TAG = "det.state"  # registry.runs.tracking
QUEUE_REASON_TAG = "det.queue_reason"  # why a QUEUED or PREEMPTED trial waits (flows)
HEARTBEAT_TAG = "det.heartbeat"  # registry.runs.tracking
PARENT_TAG = "mlflow.parentRunId"  # registry.runs.tracking
CHECKPOINT_TAG = "det.checkpoint."  # registry.checkpoints.store
FLOW_PROCESS_TAG = "det.flow_process"  # registry.runs.run_states
ORPHAN_AFTER_S = 60.0  # registry.runs.run_states
PACKED = "zlib-chunks:"  # a large tag's value when its text is split: the count follows


class LargeTagError(ValueError):
    """A large tag does not fit one batch of tags even compressed (registry.runs.large_tags),
    or its chunks are missing or broken."""


def load_large_tag(tags: dict[str, str], name: str) -> str | None:
    """The text saved under ``name`` (registry.runs.large_tags: plain, or compressed chunks)."""
    value = tags.get(name)
    if value is None or not value.startswith(PACKED):
        return value
    count = value[len(PACKED) :]
    if not count.isdigit():
        raise LargeTagError(f"tag {name} is {value!r}: no chunk count after {PACKED!r}")
    chunks = [f"{name}.{i}" for i in range(1, int(count) + 1)]
    missing = [chunk for chunk in chunks if chunk not in tags]
    if missing:
        raise LargeTagError(f"tag {name} is split over {len(chunks)} tags; {missing} are missing")
    packed = "".join(tags[chunk] for chunk in chunks)
    try:
        return zlib.decompress(base64.b64decode(packed, validate=True)).decode()
    except (ValueError, zlib.error) as err:
        raise LargeTagError(f"tag {name}'s {len(chunks)} chunks do not decompress: {err}") from None


def load_large_tags(tags: dict[str, str], prefix: str) -> dict[str, str]:
    """Every large tag whose name starts with ``prefix``, by name (chunks ``NAME.<n>`` are
    parts of ``NAME``, not tags of their own)."""
    found = {}
    for key in tags:
        stem, _, index = key.rpartition(".")
        if key.startswith(prefix) and not (index.isdigit() and stem.startswith(prefix)):
            text = load_large_tag(tags, key)
            if text is not None:
                found[key] = text
    return found


def checkpoint_records_of(run: Any) -> list[dict[str, Any]]:
    """Every checkpoint recorded on ``run`` (its tags, as any client returns them), oldest
    first."""
    records = [json.loads(v) for v in load_large_tags(run.data.tags, CHECKPOINT_TAG).values()]
    return sorted(records, key=lambda r: int(r["steps_completed"]))


def validation_value(record: dict[str, Any], metric: str) -> float | None:
    """The checkpoint's validation value of ``metric``, if it was validated with one."""
    value = (record.get("validation_metrics") or {}).get(metric)
    return float(value) if isinstance(value, int | float) else None


def rank_by_metric(
    records: list[dict[str, Any]], metric: str, smaller_is_better: bool
) -> list[dict[str, Any]]:
    """The records that carry ``metric``, best first (the searcher's ordering)."""
    sign = 1.0 if smaller_is_better else -1.0
    scored = [(value, r) for r in records if (value := validation_value(r, metric)) is not None]
    return [r for _, r in sorted(scored, key=lambda s: sign * s[0])]


def orphaned(parent: Any, now: float | None = None) -> bool:
    """Whether a RUNNING experiment run has no flow behind it: its heartbeat is older than
    ``ORPHAN_AFTER_S``, or the process that beat ran on this host and is gone (the rule
    registry.runs.run_states.end_orphans applies)."""
    beat = float(parent.data.tags.get(HEARTBEAT_TAG) or 0)
    if (time.time() if now is None else now) - beat > ORPHAN_AFTER_S:
        return True
    host, _, rest = (parent.data.tags.get(FLOW_PROCESS_TAG) or "").partition(" ")
    pid_text, _, started = rest.partition(" ")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    return _process_start(int(pid_text)) not in (None, started)


def _process_start(pid: int) -> str | None:
    """``psutil.Process(pid).create_time()`` as run_states writes it ("gone" when there is
    no such process, None when it cannot be known)."""
    import psutil

    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return None
