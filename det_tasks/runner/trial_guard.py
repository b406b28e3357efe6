"""The guard of a process that runs trials (``det_tasks.runner.trial_processes``): when that
process dies without ending its trial's processes (SIGKILL, the OOM killer, a Dask worker
that exits at once because its Nanny died), the guard ends them.

``python -m det_tasks.runner.trial_guard PID MARK``: it watches PID (a pidfd: woken the
moment it exits), and every ``LOOK_S`` notes PID's descendants that are not the platform's
(the runner sends the ones to keep, one JSON list a line, on the guard's stdin, as a
trial begins, and ``null`` once it has ended). Once PID is
gone it ends those it noted, their descendants, and every process whose environment carries
MARK (a trial's process started after the last look, or reparented away): SIGTERM, a short
grace, SIGKILL. It ignores the terminal's and the group's SIGINT, SIGTERM and SIGHUP: it
ends with its runner, after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from collections.abc import Iterator

import psutil

from det_tasks.runner.trial_processes import OWNERS_ENV, end_processes, is_guard

__all__ = ["LOOK_S", "guard"]

LOOK_S = 0.5  # how often the runner's descendants are noted

Key = tuple[int, float]


def guard(pid: int, mark: str) -> int:
    """Watch ``pid`` until it exits, then end the trial processes it left; returns 0."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        runner = psutil.Process(pid)
        if mark != f"{pid}-{runner.create_time():.3f}":  # the pid is another process's now
            raise psutil.NoSuchProcess(pid)
        watch = os.pidfd_open(pid)
    except (psutil.Error, OSError):
        # Gone before this guard could watch it (a flow run forked warm can start, and be
        # killed, within an interpreter's start): nothing was noted, but what it started
        # carries its mark.
        end_processes(list(_marked(mark)))
        return 0
    kept: set[Key] = set()
    seen: dict[Key, psutil.Process] = {}
    stdin: int | None = sys.stdin.fileno()
    pending = b""
    active = False  # a trial runs: its runner's descendants are looked at (each look costs
    # about 10 ms of CPU among 200 processes: an idle worker's guard does not look)
    while True:
        ready, _, _ = select.select(
            [watch, *([stdin] if stdin is not None else [])], [], [], LOOK_S
        )
        if watch in ready:
            break
        if stdin is not None and stdin in ready:
            chunk = os.read(stdin, 1 << 16)
            stdin = stdin if chunk else None  # closed: the pidfd says whether it exited
            *lines, pending = (pending + chunk).split(b"\n")
            if lines:  # the runner's descendants to keep; null: no trial runs now
                told = json.loads(lines[-1])
                active = told is not None
                kept = {(int(p), float(t)) for p, t in told} if active else kept
                seen = seen if active else {}
        if active:
            _note(runner, kept, seen)
    end_processes(_left(seen, kept, mark))
    return 0


def _note(runner: psutil.Process, kept: set[Key], seen: dict[Key, psutil.Process]) -> None:
    """Note the runner's descendants that are the trial's; forget the ones that ended."""
    with contextlib.suppress(psutil.Error):
        for child in runner.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                key = (child.pid, child.create_time())
                if key not in kept and not is_guard(child):
                    seen.setdefault(key, child)
    for key in [k for k, p in seen.items() if not p.is_running()]:
        del seen[key]


def _left(seen: dict[Key, psutil.Process], kept: set[Key], mark: str) -> list[psutil.Process]:
    """The trial's processes still running: those noted, their descendants, and those
    marked as started under the runner."""
    found: dict[int, psutil.Process] = {}
    for process in seen.values():
        if process.is_running():  # is_running compares the create time: not a reused pid
            found[process.pid] = process
            with contextlib.suppress(psutil.Error):
                found.update({c.pid: c for c in process.children(recursive=True)})
    for process in _marked(mark):
        found.setdefault(process.pid, process)
    # Guards (this one, a nested det-tasks run's) end on their own, after their runner.
    return [p for p in found.values() if (p.pid, _created(p)) not in kept and not is_guard(p)]


def _marked(mark: str) -> Iterator[psutil.Process]:
    """Processes whose environment names ``mark`` among their runners."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if mark in process.environ().get(OWNERS_ENV, "").split(","):
                yield process


def _created(process: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        return process.create_time()
    return 0.0


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1]), sys.argv[2]))
