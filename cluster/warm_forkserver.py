"""The forkserver the warm Dask workers fork from: what it imports before it forks them.

Why: a worker forked from a server that has imported torch, the harness and the MLflow/S3
clients starts in well under a second instead of importing them itself (a restart after a
crash or recycling too). ``cluster.forkserver_heap`` comes last: it imports what a trial's
first step needs and freezes that heap so the workers keep sharing it."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["configure", "preload_modules"]


def preload_modules() -> list[str]:
    """What the forkserver imports, in order. Dask before the main module: Dask gives its
    loggers their own handler only where the root logger has none yet, and importing
    Prefect (which the main module does) gives the root one; the workers then printed
    Dask's INFO lines in Prefect's format after the flow's last line."""
    return [
        "__main__",
        "distributed",
        *_main_module_by_name(),
        "cluster.held_trials",
        "cluster.forkserver_heap",
    ]


def configure(context: Any) -> None:
    """Give ``context`` (a multiprocessing context) our preload list; it takes effect when
    the forkserver starts."""
    context.set_forkserver_preload(preload_modules())


def _main_module_by_name() -> list[str]:
    """The main module of ``python -m NAME`` (``flows.experiment``, Prefect's engine). Why:
    every forked child re-runs the main module (as ``__mp_main__``), and the forkserver's
    ``"__main__"`` preload covers only a main script run by path; each child then imported
    Prefect itself, ~0.9 s of a worker's start."""
    name = getattr(sys.modules["__main__"].__spec__, "name", None)
    if not name or name == "__main__" or name.endswith(".__main__"):
        return []  # a script by path, or a package's __main__ (children do not re-run it)
    return [name]
