"""The forkserver the warm Dask workers fork from: what it imports before it forks them.

Why: a worker forked from a server that has imported torch, the harness and the MLflow/S3
clients starts in well under a second instead of importing them itself (a restart after a
crash or recycling too). ``cluster.forkserver_heap`` comes last: it imports what a trial's
first step needs and freezes that heap so the workers keep sharing it.

The run's main module (``python -m flows.experiment``, Prefect's engine) is not among them:
a worker needs none of it (Dask pickles what ``__main__`` defines by value), and it imports
Prefect, ~0.8 CPU seconds of every forkserver's start. ``cluster.forkserver_main`` tells the
forked children it is already in place, so they do not run it again either."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["MAIN_MODULE_ENV", "configure", "preload_modules"]

# The main module's name, for cluster.forkserver_main in the forkserver (which inherits the
# environment of the process that starts it).
MAIN_MODULE_ENV = "DET_TASKS_FORKSERVER_MAIN_MODULE"


def preload_modules() -> list[str]:
    """What the forkserver imports, in order. ``"__main__"`` covers a main script run by
    path (multiprocessing re-runs it in the forkserver once instead of in every child);
    ``cluster.forkserver_main`` covers ``python -m NAME``."""
    return [
        "__main__",
        "cluster.forkserver_main",
        "distributed",
        "cluster.held_trials",
        "det_tasks.runner.held",  # the held trial's harness and torch (held_trials has none)
        "cluster.forkserver_heap",
    ]


def configure(context: Any) -> None:
    """Give ``context`` (a multiprocessing context) our preload list and the main module's
    name; both take effect when the forkserver starts."""
    name = main_module_by_name()
    if name:
        os.environ[MAIN_MODULE_ENV] = name
    else:
        os.environ.pop(MAIN_MODULE_ENV, None)
    context.set_forkserver_preload(preload_modules())


def main_module_by_name() -> str | None:
    """The main module of ``python -m NAME`` (``flows.experiment``, Prefect's engine), which
    every forked child would otherwise re-run as ``__mp_main__`` (importing Prefect, ~0.9 s
    of a worker's start); None for a script run by path or a package's ``__main__``
    (children do not re-run those by name)."""
    name = getattr(sys.modules["__main__"].__spec__, "name", None)
    if not name or name == "__main__" or name.endswith(".__main__"):
        return None
    return str(name)
