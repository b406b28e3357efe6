"""What a DataLoader worker's failure says, turned back into the user's terms.

torch re-raises an exception from a DataLoader worker process in the trial's process with
the worker's whole traceback as text in its message (``Caught ValueError in DataLoader
worker process 0. Original Traceback ...``): the live traceback then holds only torch's and
the platform's frames, and the user's ``__getitem__`` is buried in the text. A worker killed
by a signal reads ``DataLoader worker (pid(s) 123) exited unexpectedly``, naming neither
the signal nor a cause. This module reads both back: the worker's frames and error line,
and the signal of a dead worker with its likely cause (``det_tasks.exit_signals``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import traceback
from collections.abc import Iterator
from typing import Any

from det_tasks.exit_signals import signal_cause

__all__ = ["WorkerTraceback", "loader_worker_death", "worker_traceback"]

_CAUGHT = re.compile(r"Caught \w+ in DataLoader worker process (\d+)\.\nOriginal Traceback")
_HEADER = "Traceback (most recent call last):\n"
_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (.+)$')
_DIED = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly|is killed)"
)
_KILLED_BY = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)\.")
DYING_WAIT_S = 1.0  # for a worker whose pipe broke to be seen dead
# strsignal's words ("Killed", "Bus error") -> the signal: torch names a dead worker's signal so.
_BY_DESCRIPTION = {
    (signal.strsignal(s) or "").lower(): s for s in signal.Signals if signal.strsignal(s)
}


@dataclasses.dataclass(frozen=True)
class WorkerTraceback:
    """A DataLoader worker's traceback, read back from the text torch re-raised."""

    worker: int  # the loader's worker number (0-based)
    frames: list[traceback.FrameSummary]  # outermost first, every frame (torch's too)
    error: str  # the worker's exception as Python printed it: "ValueError: bad row 3"


def worker_traceback(err: BaseException) -> WorkerTraceback | None:
    """The worker's traceback when ``err`` is a DataLoader worker's exception re-raised in
    this process; None for any other exception. Of a chained exception in the worker, the
    last traceback (the one raised) is kept."""
    text = _message(err)
    found = _CAUGHT.search(text)
    if found is None:
        return None
    last = text[text.rindex(_HEADER) + len(_HEADER) :]
    frames: list[traceback.FrameSummary] = []
    lines = last.splitlines()
    index = 0
    while index < len(lines) and (lines[index].startswith("  ") or not lines[index]):
        match = _FRAME.match(lines[index])
        if match:
            path, line, function = match.groups()
            frames.append(traceback.FrameSummary(path, int(line), function, lookup_line=False))
        index += 1
    error = "\n".join(lines[index:]).strip() or type(err).__name__
    return WorkerTraceback(int(found.group(1)), frames, error)


def _message(err: BaseException) -> str:
    """The message torch built (a KeyError's is its first argument, not its repr)."""
    first = err.args[0] if err.args else ""
    return first if isinstance(first, str) else str(err)


def loader_worker_death(err: BaseException) -> str | None:
    """``DataLoader worker process (pid N) was killed by signal 9 (SIGKILL): out of memory?
    ...`` when ``err`` says a DataLoader worker died (or its pipe broke as it died), with
    the signal and its likely cause where they can be found; None for any other exception."""
    died = _DIED.search(str(err))
    if died is not None:
        pids = died.group(1).replace(" ", "")
        exitcode = _signal_in_chain(err) or _exitcode_in_frames(err)
    elif isinstance(err, (ConnectionError, EOFError)):
        # The worker's pipe broke before torch saw the worker gone: it re-raises as is.
        found = _dead_worker_of_the_loader(err)
        if found is None:
            return None
        pids, exitcode = str(found[0]), found[1]
    else:
        return None
    if exitcode is None:
        return (
            f"DataLoader worker process (pid {pids}) exited unexpectedly (its exit code is "
            "unknown): killed by a signal? SIGKILL is most often the kernel's OOM killer "
            "(see `dmesg`), SIGBUS a full /dev/shm"
        )
    if exitcode < 0:
        return f"DataLoader worker process (pid {pids}) was {signal_cause(-exitcode)}"
    return (
        f"DataLoader worker process (pid {pids}) exited with code {exitcode}: the dataset's "
        "code (or a library it calls) ended the process, e.g. sys.exit() or os._exit()"
    )


def _signal_in_chain(err: BaseException) -> int | None:
    """-signal from torch's own line for a worker it saw die (``is killed by signal:
    Killed.``), in the exception or the ones it was raised from."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _KILLED_BY.search(str(current))
        if found and found.group(2).strip().lower() in _BY_DESCRIPTION:
            return -int(_BY_DESCRIPTION[found.group(2).strip().lower()])
        current = current.__cause__ or current.__context__
    return None


def _torch_locals(err: BaseException) -> Iterator[dict[str, Any]]:
    """The locals of the traceback's frames in torch's DataLoader iterator."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_try_get_data":
            yield tb.tb_frame.f_locals
        tb = tb.tb_next


def _exitcode_in_frames(err: BaseException) -> int | None:
    """The exit code of a failed worker process, from torch's own frames in the live
    traceback (its DataLoader iterator keeps the ``multiprocessing`` processes)."""
    for frame_locals in _torch_locals(err):
        for worker in frame_locals.get("failed_workers") or ():
            code = getattr(worker, "exitcode", None)
            if isinstance(code, int) and code != 0:
                return code
    return None


def _dead_worker_of_the_loader(err: BaseException) -> tuple[int, int] | None:
    """(pid, exit code) of a worker process of the iterator ``err`` came through that has
    ended (waited for briefly: it may still be dying), or None."""
    for frame_locals in _torch_locals(err):
        for worker in getattr(frame_locals.get("self"), "_workers", None) or ():
            with contextlib.suppress(Exception):
                worker.join(DYING_WAIT_S)
                if worker.exitcode:
                    return int(worker.pid), int(worker.exitcode)
    return None
