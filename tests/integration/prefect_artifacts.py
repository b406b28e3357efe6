"""What a flow run shows in Prefect's Artifacts tab, read back from the real server."""

from __future__ import annotations

import json
from typing import Any


def flow_run_artifacts(flow_run_id: Any) -> dict[str, list[Any]]:
    """The flow run's artifacts (every stored row, not only the latest per key), by type."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    by_type: dict[str, list[Any]] = {}
    for artifact in found:
        by_type.setdefault(str(artifact.type), []).append(artifact)
    return by_type


def trials_table_and_progress(flow_run_id: Any) -> tuple[list[dict[str, Any]], float]:
    """The flow run's one trials table (its rows) and one progress artifact (percent);
    fails if the run stored more than one of either."""
    artifacts = flow_run_artifacts(flow_run_id)
    tables, progress = artifacts.get("table", []), artifacts.get("progress", [])
    assert len(tables) == 1, [a.key for a in tables]
    assert len(progress) == 1, [a.key for a in progress]
    data = tables[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    return list(rows), float(progress[0].data)
