"""What the ``det`` command asks of Prefect: start a deployment run, delete a run, and
re-read the settings once the command has chosen its master. Starting a run and reading
runs, their states and their logs go through ``flows.prefect_rest`` (Prefect's REST API, no
Prefect import: about 1.3 s less per command); deleting one through Prefect's client."""

from __future__ import annotations

import datetime
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
    """A new flow run of ``deployment`` (flows.prefect_rest.FlowRun: its ``id``), not waited
    for, as Prefect's ``run_deployment(..., timeout=0)`` starts one."""
    from flows.prefect_rest import PrefectError, create_deployment_run

    try:
        return create_deployment_run(deployment, parameters, tags)
    except PrefectError as err:  # a missing deployment (404), a server down or refusing
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
    """A flow run's logs, read in order a page at a time over Prefect's REST API
    (``flows.prefect_rest``: no Prefect import, about 1 s less per ``det experiment logs``);
    ``task_name_contains``: only those of its task runs whose name contains it (one
    trial's)."""

    def __init__(self, flow_run_id: Any, task_name_contains: str | None) -> None:
        self.flow_run_id = flow_run_id
        self.task_name_contains = task_name_contains
        self.seen = 0

    def state(self) -> str:
        """The run's state type (``COMPLETED``, ``RUNNING``, ...)."""
        from flows import prefect_rest

        return prefect_rest.read_flow_run(self.flow_run_id).state

    def next_lines(self) -> list[str]:
        """The log lines written since the last call, each ``HH:MM:SS message`` (UTC, as
        Prefect's records are)."""
        from flows import prefect_rest

        tasks = None
        if self.task_name_contains is not None:
            tasks = prefect_rest.task_run_ids(self.flow_run_id, self.task_name_contains)
        logs = prefect_rest.read_logs(self.flow_run_id, self.seen, tasks)
        self.seen += len(logs)
        return [f"{_clock(log['timestamp'])} {log['message']}" for log in logs]


def _clock(timestamp: str) -> str:
    return f"{datetime.datetime.fromisoformat(timestamp):%H:%M:%S}"


@contextmanager
def log_reader(flow_run_id: Any, task_name_contains: str | None = None) -> Iterator[LogReader]:
    """A ``LogReader`` on the run (kept a context manager: its callers close it)."""
    yield LogReader(flow_run_id, task_name_contains)
