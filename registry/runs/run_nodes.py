"""The hosts a trial ran on, kept on its run: each process that opens the trial's services
(a worker building or restoring it, a ``det-tasks run`` segment) adds its host to the run's
``det.nodes`` tag, so ``det experiment describe`` names them after the run has ended. On a
Slurm site these are the compute nodes of its worker jobs."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_NODES", "NODES_TAG", "nodes_of", "record_node"]

NODES_TAG = "det.nodes"
MAX_NODES = 50  # the newest ones: a tag's value stays far below MLflow's 8,000 characters


def nodes_of(tags: Mapping[str, str]) -> list[str]:
    """The hosts a run's tags name, oldest first (a host the trial came back to counts again)."""
    text = tags.get(NODES_TAG, "")
    return text.split(",") if text else []


def record_node(client: Any, run_id: str, host: str | None = None) -> None:
    """Add ``host`` (default: this one) to the run's hosts, unless it is the last named."""
    host = host or socket.gethostname()
    nodes = nodes_of(client.get_run(run_id).data.tags)
    if nodes[-1:] != [host]:
        client.set_tag(run_id, NODES_TAG, ",".join([*nodes, host][-MAX_NODES:]))
