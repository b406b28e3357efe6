"""``core.SearcherContext``: the legacy ``operations()`` API (deprecated in Determined
0.38, still in the scripts teams bring). One operation per trial, whose length is the
searcher's: ``searcher.max_length`` of the config, or the rung an ASHA search gives the
trial (in batches). Its progress reports tell the platform how far the trial got."""

from __future__ import annotations

import enum
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from det_tasks.distributed import DistributedContext
from det_tasks.run_services import RunServices, TrialControl

__all__ = ["SearcherContext", "SearcherMode", "SearcherOperation", "Unit", "rung_stop"]

log = logging.getLogger("determined.core")

_DEPRECATED = (
    "SearcherContext.operations() was deprecated in Determined 0.38.0: set the training "
    "length in the training code (det_tasks still serves it)"
)


class Unit(enum.Enum):
    EPOCHS = "EPOCHS"
    RECORDS = "RECORDS"
    BATCHES = "BATCHES"


class SearcherMode(enum.Enum):
    """``WorkersAskChief``: every worker iterates in step with the chief; ``ChiefOnly``:
    only the chief does."""

    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHEIF_ONLY"  # Determined's own spelling


class SearcherOperation:
    """Train until ``length`` (absolute, in the searcher's unit), then ``report_completed``."""

    def __init__(self, length: int, is_chief: bool, services: RunServices | None) -> None:
        self._length = length
        self._is_chief = is_chief
        self._services = services
        self._completed = False

    @property
    def length(self) -> int:
        return self._length

    def report_progress(self, length: float) -> None:
        """How far training got, in the unit of ``length``."""
        self._chief_only("report_progress")
        if self._completed and length != self._length:
            raise RuntimeError("you must not call op.report_progress() after op.report_completed()")
        log.info("progress report: %s/%s", length, self._length)
        if self._services is not None:
            self._services.record_position(int(length), self._length, False)

    def report_completed(self, searcher_metric: Any) -> None:
        """The operation's length was trained; ``searcher_metric`` is logged (the searcher
        reads its metric from ``report_validation_metrics``)."""
        self._chief_only("report_completed")
        if self._completed:
            raise RuntimeError("you may only call op.report_completed() once")
        self._completed = True
        log.info("SearcherOperation complete: searcher_metric=%s", searcher_metric)
        if self._services is not None:
            self._services.record_position(self._length, self._length, False)

    def _chief_only(self, what: str) -> None:
        if not self._is_chief:
            raise RuntimeError(f"you must only call op.{what}() from the chief worker")


class SearcherContext:
    """Yields the trial's one ``SearcherOperation``; off the platform its length is 1, as
    Determined's dummy searcher's is."""

    def __init__(
        self,
        dist: DistributedContext,
        length: int,
        units: Unit | None,
        services: RunServices | None,
    ) -> None:
        self._dist = dist
        self._length = length
        self._units = units
        self._services = services
        self.operations_used = False  # a legacy script: its operation's length ends it

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        warnings.warn(_DEPRECATED, FutureWarning, stacklevel=2)
        self.operations_used = True
        mode = SearcherMode(searcher_mode)
        if self._dist.rank == 0:
            op = SearcherOperation(self._length, True, self._services)
            if mode == SearcherMode.WorkersAskChief:
                self._dist.broadcast(op.length)
            yield op
            if not op._completed:
                raise RuntimeError("you must call op.report_completed() on each operation")
            if mode == SearcherMode.WorkersAskChief:
                self._dist.broadcast(None)
            return
        if mode != SearcherMode.WorkersAskChief:
            raise RuntimeError(
                "you cannot call searcher.operations(searcher_mode=ChiefOnly) from a non-chief "
                "worker"
            )
        while (length := self._dist.broadcast(None)) is not None:
            yield SearcherOperation(length, False, None)

    def acknowledge_out_of_ops(self) -> None:
        """Deprecated in Determined 0.38 and ignored there too."""

    def get_configured_units(self) -> Unit | None:
        """The unit of ``searcher.max_length`` (None: a bare number, or none)."""
        return self._units


def configured_length(
    searcher_length: dict[str, int] | None, conf: dict[str, Any]
) -> tuple[int | None, Unit | None]:
    """The operation's length and unit: the runner's (a rung, ``--max-batches``) when it
    gave one, else the config's ``searcher.max_length``."""
    units = {"batches": Unit.BATCHES, "epochs": Unit.EPOCHS, "records": Unit.RECORDS}
    if searcher_length:
        ((unit, value),) = searcher_length.items()
        return int(value), units.get(unit)
    max_length = (conf.get("searcher") or {}).get("max_length")
    if isinstance(max_length, int) and not isinstance(max_length, bool):
        return max_length, None
    if isinstance(max_length, dict) and len(max_length) == 1:
        ((unit, value),) = max_length.items()
        return int(value), units.get(unit)
    return None, None


def rung_stop(
    searcher: SearcherContext,
    searcher_length: dict[str, int] | None,
    conf: dict[str, Any],
    control: TrialControl,
) -> Callable[[], bool]:
    """Whether a script that does not use ``operations()`` (Determined 0.38's form) has
    reached the length the searcher gave it: an ASHA rung, or ASHA's ``max_time`` (0.38's
    ASHA stops a trial at its top rung too). Other searchers let the script decide how long
    it trains, unless the platform runs it for less than the trial's length."""
    length = (searcher_length or {}).get("batches")
    section = conf.get("searcher") or {}
    full = _full_length_in_batches(section)
    if length is None or (
        section.get("name") != "adaptive_asha" and (full is None or length >= full)
    ):
        return lambda: False
    said: list[bool] = []

    def reached() -> bool:
        if searcher.operations_used or control.steps_completed < length:
            return False
        if not said:
            said.append(True)
            log.info(
                "the searcher's length, batch %d, is reached: should_preempt() is True", length
            )
        return True

    return reached


def _full_length_in_batches(section: dict[str, Any]) -> int | None:
    """The trial's whole length in batches from the config's searcher section, if it has
    one: ``max_length: {batches: N}``, or ``time_metric: batches`` with ``max_time``."""
    max_length = section.get("max_length")
    if isinstance(max_length, dict) and set(max_length) == {"batches"}:
        return int(max_length["batches"])
    if section.get("time_metric") == "batches" and section.get("max_time") is not None:
        return int(section["max_time"])
    return None
