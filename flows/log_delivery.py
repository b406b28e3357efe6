"""A flow run's log is whole when its state says it ended.

Prefect sends log lines to its API in batches, every 2 s by default
(``PREFECT_LOGGING_TO_API_BATCH_INTERVAL``), and a flow run's final state is written
without waiting for them. A trial's last line ("checkpoint at batch 64 ...") then
reached the server up to a batch interval after the flow run said Completed, so a user or
a script reading the run's log at that moment missed where its trials ended. The flows
deliver their lines, and their tasks', before they return.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["DELIVERY_TIMEOUT_SECONDS", "deliver_logs", "logs_delivered"]

# As long as Prefect's own flush waits: a stuck API must not hold the flow's end for ever.
DELIVERY_TIMEOUT_SECONDS = 5.0


def deliver_logs(timeout: float = DELIVERY_TIMEOUT_SECONDS) -> None:
    """Send every log line queued for Prefect's API now, waiting at most ``timeout``
    seconds. Called where no event loop runs (a sync flow's body), as a flow's end is."""
    from prefect.logging.handlers import APILogWorker

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # none: this thread may wait
        APILogWorker.drain_all(timeout=timeout, at_exit=False)
    else:
        raise RuntimeError(
            "deliver_logs waits for the log worker and would block this event loop: "
            "await prefect.logging.handlers.APILogHandler.aflush() instead"
        )


@contextlib.contextmanager
def logs_delivered(timeout: float = DELIVERY_TIMEOUT_SECONDS) -> Iterator[None]:
    """Around a flow's body: its lines are on the server before it returns or raises."""
    try:
        yield
    finally:
        deliver_logs(timeout)
