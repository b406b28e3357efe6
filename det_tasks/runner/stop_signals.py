"""SIGHUP and SIGTERM during ``det-tasks run``: stop at the next batch boundary with a
checkpoint, say how to continue, and exit with the signal's conventional code (128 + its
number).

Why: a closed terminal or a dropped ssh session (SIGHUP), and ``timeout``, ``kill``,
systemd or Kubernetes (SIGTERM), otherwise end the run at once and lose every batch since
the last periodic checkpoint. A second signal stops at once, without a checkpoint. A signal
ignored when the process started (``nohup``, ``trap '' HUP``) stays ignored. Ctrl-C keeps
Python's own meaning here (an immediate stop)."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from det_tasks.errors import TrialStopped

__all__ = ["SignalStop", "StopSignals", "StoppedAtOnce", "resume_command"]

_HANDLED = (signal.SIGHUP, signal.SIGTERM)
_PAUSED = "PAUSED"  # Determined's state for a trial stopped to continue later


class SignalStop(TrialStopped):
    """Training stopped at a batch boundary on a signal, with a checkpoint (``reference``:
    what ``--resume`` takes) at ``batches``; the run ends KILLED with det.state PAUSED."""

    def __init__(self, signum: int, batches: int, reference: str | None) -> None:
        super().__init__(_PAUSED, f"{signal.Signals(signum).name} at batch {batches}")
        self.signum, self.batches, self.reference = signum, batches, reference

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGHUP or SIGTERM: the run stops where it is, without a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The run's SIGHUP/SIGTERM: the first asks each watched trial context to stop at its
    next batch boundary (the loop then checkpoints); the second raises StoppedAtOnce."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._contexts: list[Any] = []

    def watch(self, context: Any) -> None:
        """Stop this trial context (a PyTorchTrialContext) on the first signal."""
        self._contexts.append(context)
        if self.signum is not None:
            context.set_stop_requested(True)

    def raise_if_stopped(self, batches: int, reference: str | None) -> None:
        """After training returned: SignalStop if a signal ended it early."""
        if self.signum is not None:
            raise SignalStop(self.signum, batches, reference)

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """The handlers while the block runs (main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in _HANDLED}
        handled = [s for s in _HANDLED if previous[s] != signal.SIG_IGN]
        for sig in handled:
            signal.signal(sig, self._handle)
        try:
            yield
        finally:
            for sig in handled:
                signal.signal(sig, previous[sig])

    def _handle(self, signum: int, frame: Any) -> None:
        # Nothing printed here: the main thread may be inside a write to stderr (the
        # progress bar), and a second write from the handler would be re-entrant.
        if self.signum is not None or not self._contexts:
            # The second signal; or a script's own loop, which this runner cannot reach.
            raise StoppedAtOnce(signum)
        self.signum = signum
        for context in self._contexts:
            context.set_stop_requested(True)


def resume_command(argv: Sequence[str], reference: str) -> str:
    """``det-tasks run`` with the same arguments, continuing from ``reference`` (any earlier
    ``--resume`` replaced)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    return shlex.join(["det-tasks", *kept, "--resume", reference])
