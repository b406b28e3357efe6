"""Session-wide test settings."""

from __future__ import annotations

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


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_PREVIOUS, None)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
