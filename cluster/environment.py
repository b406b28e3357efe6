"""Where the cluster a flow uses is: the environment variables that name it, and whether
its scheduler answers. A light module, so the ``det`` command, ``infra`` and the warm
services check read them without importing Dask."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from det_tasks.errors import DetTasksError

__all__ = ["EXPECTED_WORKERS_ENV", "SCHEDULER_ENV", "accepts", "stack_scheduler"]

# tcp://host:8786 of a running Dask scheduler (the stack's); unset: an embedded cluster.
SCHEDULER_ENV = "DET_TASKS_DASK_SCHEDULER"
# How many workers a flow waits for before it places steps (set by background_cluster).
EXPECTED_WORKERS_ENV = "DET_TASKS_DASK_WAIT_WORKERS"


def accepts(address: str) -> bool:
    """Whether something listens at ``tcp://host:port``."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def stack_scheduler(why_needed: str) -> Iterator[str]:
    """The stack's scheduler address, for a ``det`` command's RPC in the block: unset, or
    unreachable (OSError in the block), the user reads one line saying so."""
    address = os.environ.get(SCHEDULER_ENV)
    if not address:
        raise DetTasksError(f"{SCHEDULER_ENV} is not set: {why_needed}")
    try:
        yield address
    except OSError as err:
        raise DetTasksError(
            f"cannot reach the Dask scheduler at {address} ({err}): is the stack up (make up)?"
        ) from None
