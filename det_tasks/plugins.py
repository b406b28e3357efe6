"""Optional capabilities other packages provide through entry points, so det_tasks can use
them without importing them: checkpoint URI resolvers, run services (MLflow/S3), CLI
subcommands."""

from __future__ import annotations

import importlib.metadata
from typing import Any

__all__ = ["load_all", "load_one"]


def load_one(group: str, name: str) -> Any | None:
    for entry in importlib.metadata.entry_points(group=group):
        if entry.name == name:
            return entry.load()
    return None


def load_all(group: str) -> dict[str, Any]:
    return {e.name: e.load() for e in importlib.metadata.entry_points(group=group)}
