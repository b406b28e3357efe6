"""``core.PreemptContext``: ``should_preempt()`` is True once the platform asks the trial
to stop (``det experiment pause``, cancel, a more urgent experiment, SIGTERM); the script
then checkpoints and returns, and activate continues it from ``latest_checkpoint``.

Reading the request is one flag read (the runner sets it from its own thread), so unlike
Determined's long-polling watcher it is cheap enough to call every batch."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

from det_tasks.distributed import DistributedContext
from det_tasks.run_services import TrialControl

__all__ = ["PreemptContext", "PreemptMode"]

log = logging.getLogger("determined.core")


class PreemptMode(enum.Enum):
    """Who may call ``should_preempt()``: every worker in step, the chief deciding
    (``WorkersAskChief``); only the chief (``ChiefOnly``); each worker on its own
    (``WorkersAskMaster``)."""

    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"
    WorkersAskMaster = "WORKERS_ASK_MASTER"


class PreemptContext:
    """The trial's stop request, read through its ``TrialControl``. Off the platform
    nothing sets it, so ``should_preempt()`` stays False (Determined's dummy)."""

    def __init__(
        self,
        control: TrialControl,
        dist: DistributedContext,
        preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
        searcher_stop: Callable[[], bool] | None = None,
    ) -> None:
        self._control = control
        self._dist = dist
        self._mode = PreemptMode(preempt_mode)
        self._started = False
        # True once the searcher wants the trial to stop where it is (an ASHA rung reached):
        # Determined 0.38 tells a script so through should_preempt(), not acknowledged as a
        # pause (the trial's segment ends; the searcher may continue it later).
        self._searcher_stop = searcher_stop or (lambda: False)

    def start(self) -> PreemptContext:
        if self._started:
            raise RuntimeError("you cannot call PreemptContext.start() multiple times")
        self._started = True
        self._control.claim()  # the runner now waits for this script to stop by itself
        return self

    def close(self) -> None:
        """Nothing to release: the request is a flag the runner owns."""

    def __enter__(self) -> PreemptContext:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()

    def should_preempt(self, auto_ack: bool = True) -> bool:
        """True once the trial should checkpoint and return. With ``auto_ack`` the first
        True also acknowledges the request (the trial will be continued later)."""
        if not self._started:
            raise RuntimeError(
                "you cannot call PreemptContext.should_preempt() before PreemptContext.start() "
                "(use it inside `with det.core.init() as core_context:`)"
            )
        asks_itself = self._dist.rank == 0 or self._mode == PreemptMode.WorkersAskMaster
        if asks_itself:
            out = self._control.should_preempt()
            if auto_ack and out and not self._control.acknowledged:
                self.acknowledge_preemption_signal()
            if not out and self._searcher_stop():
                out = True
            if self._mode == PreemptMode.WorkersAskChief:
                self._dist.broadcast(out)
            return out
        if self._mode == PreemptMode.ChiefOnly:
            raise RuntimeError(
                "PreemptContext was configured with preempt_mode=ChiefOnly but "
                f".should_preempt() was called from non-chief worker of rank={self._dist.rank}"
            )
        return bool(self._dist.broadcast(None))

    def acknowledge_preemption_signal(self) -> None:
        """The trial will stop and expects to be continued (its run ends PAUSED, not
        COMPLETED)."""
        log.info("preemption acknowledged")
        self._control.acknowledge()
