"""The one object a trial reaches the platform through: ``RunServices``.

A launcher (``det-tasks run``, a held trial, a flow's job) that has platform services (the
MLflow sink and S3 store of the ``det_tasks.run_services`` entry point) provides them for
the duration of a block; ``det.pytorch.init()`` and ``det.core.init()`` inside it use them
instead of local ones. What it carries, and its local (null) variant where nothing is
provided, as Determined's ``core.Context`` has real and ``Dummy*`` parts:

- ``metrics_sink``: where metrics go (an in-memory sink locally);
- ``checkpoint_store``: where checkpoints go (a local folder locally);
- ``control``: the two-way channel with the runner: its stop request (a pause, cancel,
  preemption or SIGTERM: ``should_preempt()``) and the trial's own reports back (how far it
  trained, an early exit);
- ``searcher_length``: how long the searcher wants the trial trained;
- ``cluster_info``: ``det.get_cluster_info()`` (None off the platform);
- ``tensorboard_dir`` and ``run_url``.

A context variable, not a global: each task's block is its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from det_tasks import cluster_info as cluster_info_lib
from det_tasks.sinks import record_position_on

__all__ = ["RunServices", "TrialControl", "current_services", "provide", "resolved"]


class TrialControl:
    """The runner's stop request to a trial and the trial's reports back to the runner.

    ``claim()`` is called by code that will honour the stop request itself (a Core API
    script's ``core.init()``): the runner then stops at the script's own boundary instead of
    at once (``on_claim`` lets it start watching)."""

    def __init__(
        self,
        on_claim: Callable[[TrialControl], None] | None = None,
        stop: threading.Event | None = None,
        abandoned: threading.Event | None = None,
    ) -> None:
        self.stop = stop if stop is not None else threading.Event()
        # Set with the stop request when the runner gives the training to another process
        # (its worker is closing): the stop then reports nothing since the last report, as
        # the replay from the last checkpoint reports those batches again.
        self.abandoned = abandoned if abandoned is not None else threading.Event()
        self.acknowledged = False
        self.claimed = False
        self.early_exit: str | None = None  # an EarlyExitReason's value, reported by the trial
        self.steps_completed = 0  # the furthest batch the trial reported
        self._on_claim = on_claim

    def claim(self) -> None:
        """The trial polls ``should_preempt()`` from now on (idempotent)."""
        if not self.claimed:
            self.claimed = True
            if self._on_claim is not None:
                self._on_claim(self)

    def request_stop(self) -> None:
        """Ask the trial to stop at its next boundary (and checkpoint)."""
        self.stop.set()

    def set_stop_requested(self, stop_requested: bool) -> None:
        """What ``runner.stop_signals.StopSignals`` calls on the contexts it watches."""
        if stop_requested:
            self.stop.set()
        else:
            self.stop.clear()

    def should_preempt(self) -> bool:
        return self.stop.is_set()

    def abandon(self) -> None:
        """Stop at the next boundary without reporting: the training is replayed elsewhere."""
        self.abandoned.set()
        self.stop.set()

    def acknowledge(self) -> None:
        """The trial will stop and expects to be continued later."""
        self.acknowledged = True

    def reached(self, steps_completed: int) -> None:
        """The trial reported ``steps_completed`` (a metric or a checkpoint)."""
        if steps_completed > self.steps_completed:
            self.steps_completed = int(steps_completed)


@dataclasses.dataclass(frozen=True)
class RunServices:
    """What a launched trial (class or script) reaches the platform through; fields left
    None take their local variant where they are used."""

    metrics_sink: Any = None
    checkpoint_store: Any = None
    tensorboard_dir: str | None = None
    run_url: str | None = None  # where the run can be seen (an MLflow UI page), if anywhere
    control: TrialControl = dataclasses.field(default_factory=TrialControl)
    # {"batches": N} or {"epochs": N}: the searcher's length (None: the trial decides).
    searcher_length: dict[str, int] | None = None
    cluster_info: cluster_info_lib.ClusterInfo | None = None

    def record_position(self, trained: int, length: int | None, stop_requested: bool) -> None:
        """Tell the platform how far the trial got (sinks.record_position_on), so whoever
        ends its run knows whether it may be recorded COMPLETED."""
        if self.metrics_sink is not None:
            record_position_on(self.metrics_sink, trained, length, stop_requested)


_SERVICES: contextvars.ContextVar[RunServices | None] = contextvars.ContextVar(
    "det_tasks_run_services", default=None
)


def current_services() -> RunServices | None:
    """The services provided to this block, if any."""
    return _SERVICES.get()


def resolved() -> RunServices | None:
    """The services provided to this block with the cluster info filled in from the
    environment (a launched process that was given no services sees only its info); None
    off the platform, where the trial uses its local variants."""
    provided = _SERVICES.get()
    if provided is not None and provided.cluster_info is not None:
        return provided
    info = cluster_info_lib.get_cluster_info()
    if provided is None:
        if info is None:
            return None
        return RunServices(cluster_info=info, searcher_length=info.searcher_length)
    if info is None:
        return provided
    length = provided.searcher_length or info.searcher_length
    return dataclasses.replace(provided, cluster_info=info, searcher_length=length)


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
