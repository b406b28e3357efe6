"""The metrics sink and checkpoint store a launcher hands to ``det.pytorch.init()``.

A runner (``det-tasks run``, a held trial, a flow's job) that has platform services (the
MLflow sink, the S3 store: the ``det_tasks.run_services`` entry point) provides them for the
duration of a block; ``init()`` inside it, called by the user's script or trial, uses them
instead of local ones. A context variable, not a global: each task's block is its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["RunServices", "current_services", "provide"]


@dataclasses.dataclass(frozen=True)
class RunServices:
    """Sink and store a launcher hands to ``det.pytorch.init()`` inside a launched script."""

    metrics_sink: Any = None
    checkpoint_store: Any = None
    tensorboard_dir: str | None = None
    run_url: str | None = None  # where the run can be seen (an MLflow UI page), if anywhere


_SERVICES: contextvars.ContextVar[RunServices | None] = contextvars.ContextVar(
    "det_tasks_run_services", default=None
)


def current_services() -> RunServices | None:
    """The services provided to this block, if any."""
    return _SERVICES.get()


@contextlib.contextmanager
def provide(run_services: RunServices | None) -> Iterator[None]:
    """Let ``init()`` called inside the block use ``run_services`` (None: provide nothing,
    for a runner without platform services)."""
    if run_services is None:
        yield
        return
    token = _SERVICES.set(run_services)
    try:
        yield
    finally:
        _SERVICES.reset(token)
