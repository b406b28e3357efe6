"""Session-wide test settings."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM stops the run as Ctrl-C does, so the session's fixtures tear down (the
    stack's services included) instead of outliving a CI job that was terminated."""
    session_pid = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != session_pid:  # a forked child: die as it would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)
