"""Session-wide test settings."""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import Any

import pytest

_PREVIOUS = pytest.StashKey[Any]()


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM stops the run as Ctrl-C does, so the session's fixtures tear down (the
    stack's services included) instead of outliving a CI job that was terminated."""
    session_pid = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != session_pid:  # a forked child: die as it would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        # A second SIGTERM must not cut the teardown short (SIGKILL still ends it).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt("SIGTERM")

    config.stash[_PREVIOUS] = signal.signal(signal.SIGTERM, interrupt)
    # A process forked from the session (a trial's multiprocessing.Pool or DataLoader
    # worker, run in-process by a test) gets SIGTERM's default back at once: a Python
    # handler runs only when the child's main thread is back in the interpreter, so a child
    # blocked in C code would outlive Pool.terminate() and hang the test that waits on it.
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


def _default_sigterm_in_child() -> None:
    with contextlib.suppress(ValueError):  # forked from a thread that cannot set handlers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_PREVIOUS, None)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
