"""What the ``det`` command asks of Prefect's client library: start a deployment run, read
a run's logs, delete a run, and re-read the settings once the command has chosen its
master. (Reading runs and their states goes through ``flows.prefect_rest``: quicker.)"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from det_tasks.errors import DetTasksError

__all__ = [
    "LogReader",
    "delete_flow_run",
    "log_reader",
    "reread_prefect_settings",
    "start_deployment_run",
]


def start_deployment_run(
    deployment: str, parameters: dict[str, Any], tags: list[str] | None = None
) -> Any:
    """A new flow run of ``deployment`` (Prefect's FlowRun), not waited for."""
    from prefect.deployments import run_deployment

    try:
        return run_deployment(deployment, parameters=parameters, timeout=0, tags=tags)
    except Exception as err:  # prefect raises several types for a missing deployment / server
        raise DetTasksError(
            f"could not start deployment {deployment!r} ({type(err).__name__}: {err}); is the "
            "Prefect server up and are the deployments registered (`make up` registers them)?"
        ) from None


def delete_flow_run(flow_run_id: Any) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.delete_flow_run(flow_run_id)


def reread_prefect_settings() -> None:
    """Prefect read its settings when it was imported: read them again (PREFECT_API_URL)."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


class LogReader:
    """A flow run's logs, read in order a page at a time (``task_name_contains``: only those
    of its task runs whose name contains it: one trial's)."""

    def __init__(self, client: Any, flow_run_id: Any, task_name_contains: str | None) -> None:
        self.client = client
        self.flow_run_id = flow_run_id
        self.task_name_contains = task_name_contains
        self.seen = 0

    def state(self) -> str:
        """The run's state type (``COMPLETED``, ``RUNNING``, ...)."""
        run = self.client.read_flow_run(self.flow_run_id)
        return run.state.type.value if run.state else "PENDING"

    def next_lines(self) -> list[str]:
        """The log lines written since the last call, each ``HH:MM:SS message``."""
        from prefect.client.schemas.sorting import LogSort

        logs = self.client.read_logs(self._filter(), offset=self.seen, sort=LogSort.TIMESTAMP_ASC)
        self.seen += len(logs)
        return [f"{log.timestamp:%H:%M:%S} {log.message}" for log in logs]

    def _filter(self) -> Any:
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterId,
            LogFilter,
            LogFilterFlowRunId,
            LogFilterTaskRunId,
            TaskRunFilter,
            TaskRunFilterName,
        )

        by_run = LogFilterFlowRunId(any_=[self.flow_run_id])
        if self.task_name_contains is None:
            return LogFilter(flow_run_id=by_run)
        tasks = self.client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[self.flow_run_id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=self.task_name_contains)),
        )
        ids = [t.id for t in tasks if self.task_name_contains in t.name]
        return LogFilter(flow_run_id=by_run, task_run_id=LogFilterTaskRunId(any_=ids))


@contextmanager
def log_reader(flow_run_id: Any, task_name_contains: str | None = None) -> Iterator[LogReader]:
    """A ``LogReader`` on a Prefect client that is closed after."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield LogReader(client, flow_run_id, task_name_contains)
