"""Optional capabilities other packages provide through entry points, so det_tasks can use
them without importing them: checkpoint URI resolvers, run services (MLflow/S3), CLI
subcommands."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

__all__ = ["entry_names", "load_all", "load_one"]


@functools.cache
def _entries(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """A group's entry points, listed once per process: listing scans every installed
    distribution's metadata (12 ms here), and a warm worker looks one up per trial. A plugin
    installed later is seen by processes started after it (restart warm workers)."""
    return tuple(importlib.metadata.entry_points(group=group))


def load_one(group: str, name: str) -> Any | None:
    for entry in _entries(group):
        if entry.name == name:
            return entry.load()
    return None


def load_all(group: str) -> dict[str, Any]:
    return {e.name: e.load() for e in _entries(group)}


def entry_names(group: str) -> list[str]:
    """The names registered in ``group``, without loading any of them."""
    return [e.name for e in _entries(group)]
