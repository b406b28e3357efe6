"""What reaches the terminal of ``python -m flows.*``: Prefect's own shutdown chatter (its
event queue draining, CancelledError tracebacks from the ephemeral server's tasks) is not
the user's business; the flow and task run logs are."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator
from typing import NoReturn

__all__ = [
    "CompleteMessageFilter",
    "ShutdownNoiseFilter",
    "exit_without_final_collection",
    "quiet_prefect_shutdown",
]

# The last is the ephemeral server's goodbye, which would land after the run's last line.
_NOISE = (
    "Still processing items",
    "Task was destroyed but it is pending",
    "Stopping temporary server",
)


class CompleteMessageFilter(logging.Filter):
    """On the console, errors whose message says everything (a trial's own output, a config
    field) are shown without Prefect's engine traceback around them."""

    def __init__(self, exception_types: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.exception_types = exception_types

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.exception_types):
            record.exc_info = None
            record.exc_text = None
        return True


class ShutdownNoiseFilter(logging.Filter):
    """Drops Prefect's drain-at-exit messages and cancellation tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        message = record.getMessage()
        return not any(noise in message for noise in _NOISE) and ("CancelledError" not in message)


def _handlers() -> set[logging.Handler]:
    found = set(logging.getLogger().handlers)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith(("prefect", "asyncio", "uvicorn")) and isinstance(
            logger, logging.Logger
        ):
            found.update(logger.handlers)
    return found


@contextlib.contextmanager
def quiet_prefect_shutdown(
    complete_errors: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Filter Prefect's shutdown noise on every logging handler for the block and after it
    (the ephemeral server stops at interpreter exit), and on asyncio's logger; console
    handlers also drop the traceback of ``complete_errors``."""
    noise = ShutdownNoiseFilter()
    complete = CompleteMessageFilter(complete_errors)
    for handler in _handlers():
        handler.addFilter(noise)
        if isinstance(handler, logging.StreamHandler) and complete_errors:
            handler.addFilter(complete)
    logging.getLogger("asyncio").addFilter(noise)
    yield


def exit_without_final_collection(code: int) -> NoReturn:
    """``sys.exit(code)``, minus the interpreter's last garbage collections: with torch,
    Prefect, MLflow and pandas loaded, tearing the modules down walked the whole heap and
    took 1.6-1.8 s after the command's work was done (2-core VM). Objects alive now are
    frozen out of the collector; atexit handlers (log flushing, child processes) still run.
    Only for processes that run no trial code: an object left in a reference cycle (an
    unclosed file, say) is never finalized. ``python -m flows.experiment`` imports the
    user's trial module (its module-level code runs) but trains on Dask workers; ``det``
    imports no user code."""
    gc.disable()
    gc.freeze()
    sys.exit(code)
