"""How a running experiment learns that it must stop, and in which of Determined's ways.

Every way in ends in one ``StopControl.request(mode)``:
- Ctrl-C (SIGINT), SIGHUP (a closed terminal, a dropped ssh session) or SIGTERM on the
  flow's process: ``pause`` (checkpoint, continue later), or ``cancel`` when Prefect is
  cancelling the flow run (its process worker cancels by SIGTERM); a second signal stops at
  once (``kill``: no checkpoint). A SIGHUP or SIGTERM ignored when the process started
  (``nohup``) stays ignored;
- ``det experiment pause|cancel|kill`` (flows.lifecycle): sets the key
  ``["det-tasks-stop", <experiment key>]`` in the Dask scheduler's metadata store
  (``Client.set_metadata``), which the flow reads at each wake-up (about once a second).

The flow then passes the request to its trials' workers (``cluster.steps.stop_everywhere``),
where the training loop sees it at its next batch boundary. While it runs, the flow also
beats on its MLflow parent run, so a flow that dies without a word is found
(registry.runs.run_states).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from cluster.stop_requests import STOP_STATES, record_stop, stop_requested
from cluster.worker_calls import forget_stop
from det_tasks.errors import ConfigError
from registry.runs.run_states import HEARTBEAT_S, heartbeat

__all__ = [
    "DEFAULT_STOP_GRACE_S",
    "STOP_GRACE_ENV",
    "StopControl",
    "stop_grace_s",
    "stop_signals_handled",
]

# How long a trial has, after a stop request, to reach its next batch boundary before its
# worker is killed (a trial stuck in user code never reaches one).
STOP_GRACE_ENV = "DET_TASKS_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 60.0
_logger = logging.getLogger(__name__)


def stop_grace_s() -> float:
    """``DET_TASKS_STOP_GRACE_S`` (default 60): seconds a stopping trial may take to reach its
    next batch boundary before it is killed."""
    raw = os.environ.get(STOP_GRACE_ENV, str(DEFAULT_STOP_GRACE_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(
            f"{STOP_GRACE_ENV}={raw!r}: expected a number of seconds >= 0 (how long a "
            f"stopping trial may take to reach its next batch boundary; default "
            f"{DEFAULT_STOP_GRACE_S:.0f})"
        )
    return value


class StopControl:
    """The experiment's stop request (None while it runs), from signals or the ``det``
    command, and the flow's heartbeat."""

    def __init__(
        self,
        client: Any,  # a distributed.Client
        experiment_key: str,
        mlflow: Any,
        parent_run_id: str,
        cancelling: Callable[[], bool] = lambda: False,
    ) -> None:
        self.client = client
        self.experiment_key = experiment_key
        self.mode: str | None = None
        self.signals = 0
        self._mlflow, self._parent = mlflow, parent_run_id
        self._cancelling = cancelling
        self._last_beat = 0.0
        self._pending: str | None = None  # set by a signal handler, acted on by poll()
        self.requested_at: float | None = None  # monotonic time of the first stop request
        # Why the flow paused itself, when no one asked (a full disk: flows.disk_full).
        self.why: str | None = None

    @property
    def state(self) -> str | None:
        """PAUSED or CANCELED once a stop was requested."""
        return STOP_STATES[self.mode] if self.mode else None

    def request(self, mode: str) -> bool:
        """Record a stop request; True if it changes what happens (kill overrides the
        others; a second pause or cancel changes nothing)."""
        if mode not in STOP_STATES:
            raise ValueError(f"stop mode must be one of {sorted(STOP_STATES)}, got {mode!r}")
        if self.mode == mode or (self.mode == "kill"):
            return False
        self.mode = mode
        if self.requested_at is None:
            self.requested_at = time.monotonic()
        return True

    def overdue(self, grace_s: float) -> bool:
        """A stop was requested more than ``grace_s`` seconds ago."""
        return self.requested_at is not None and time.monotonic() - self.requested_at > grace_s

    def poll(self) -> str | None:
        """A new stop request since the last poll (from a signal or the Dask variable), or
        None; beats the heartbeat when it is due."""
        now = time.time()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            with contextlib.suppress(Exception):  # a missed beat is retried next time
                heartbeat(self._mlflow, self._parent, now)
        pending, self._pending = self._pending, None
        if pending == "term":  # Prefect's worker cancels a flow run by SIGTERM
            pending = "cancel" if self._cancelling() else "pause"
        if pending is None:
            recorded = stop_requested(self.client, self.experiment_key)
            if recorded != self.mode:
                pending = recorded
        if pending is not None and self.request(pending):
            # Recorded where every step sees it: a step whose worker died is not retried
            # into a stopping experiment (flows.tasks), whoever asked for the stop.
            with contextlib.suppress(Exception):
                record_stop(self.client, self.experiment_key, pending)
            return pending
        return None

    def clear(self) -> None:
        """Forget a stop request left on the scheduler (an activated experiment runs)."""
        with contextlib.suppress(Exception):
            record_stop(self.client, self.experiment_key, None)
        with contextlib.suppress(Exception):
            self.client.run(forget_stop, self.experiment_key)

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """SIGINT, SIGHUP and SIGTERM ask for a graceful stop; the second one stops at once.
        Only the main thread can install handlers; elsewhere nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(signum: int, frame: Any) -> None:
            self.signals += 1
            if self.signals > 1:
                self._pending = "kill"
                with contextlib.suppress(OSError):  # a closed terminal cannot be written to
                    print("second signal: stopping at once, without a checkpoint", file=sys.stderr)
                raise KeyboardInterrupt  # at once: the flow's cleanup still ends the runs
            self._pending = "term" if signum == signal.SIGTERM else "pause"

        with stop_signals_handled(handle):
            yield


# SIGHUP and SIGTERM that the process inherited ignored (``nohup``, a user's ``trap '' HUP``)
# stay ignored. SIGINT is handled even then: a non-interactive shell starts a background job
# with SIGINT ignored without anyone asking, and ``kill -INT`` must still pause it.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_KEPT_IF_IGNORED = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for SIGINT, SIGTERM and SIGHUP while the block runs (main thread only),
    never over a SIGHUP or SIGTERM ignored at start; the previous handlers afterwards."""
    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    handled = [
        s for s in _STOP_SIGNALS if not (s in _KEPT_IF_IGNORED and previous[s] == signal.SIG_IGN)
    ]
    for sig in handled:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig in handled:
            signal.signal(sig, previous[sig])
