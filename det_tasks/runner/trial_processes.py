"""A trial's own processes end with the trial, and with the process that ran it.

A trial's code starts processes of its own: ``subprocess.Popen`` in ``__init__`` (a data
server, a metrics exporter), pools, DataLoader workers, and their children. Left alone they
outlive the trial (a warm Dask worker holds many trials in turn), and they outlive their
launcher: reparented to PID 1. Determined ends them with the trial's container; here:

- the process that runs trials (a Dask worker, ``det-tasks run``) becomes a *child
  subreaper* (``PR_SET_CHILD_SUBREAPER``), so an orphaned grandchild (a helper's own child
  whose parent exited) is reparented to it, not to PID 1, and stays among its descendants;
- ``begin`` notes the descendants that are not the trial's (the platform's, started before
  it); ``end`` ends every other descendant: SIGTERM, a short grace, then SIGKILL;
- a guard process (``det_tasks.runner.trial_guard``) watches the runner; if the runner dies
  at once (SIGKILL, the OOM killer, a Dask worker whose Nanny died exits with ``os._exit``)
  it ends the trial's processes it saw, and every process that carries the runner's mark in
  its environment (``DET_TASKS_TRIAL_OWNERS``, inherited by whatever the trial starts).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping

import psutil

__all__ = [
    "GRACE_S",
    "OWNERS_ENV",
    "TrialProcesses",
    "end_processes",
    "is_guard",
    "mark_what_this_process_starts",
    "own_trial_processes",
    "start_guard",
    "trial_processes",
]

logger = logging.getLogger(__name__)
OWNERS_ENV = "DET_TASKS_TRIAL_OWNERS"  # marks of every runner a process descends from
GRACE_S = 3.0  # SIGTERM, then this long, then SIGKILL
END_ROUNDS = 3  # how often end() looks for what is left
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h

Key = tuple[int, float]  # (pid, create_time): a pid the kernel reused is another process


def _key(process: psutil.Process) -> Key | None:
    with contextlib.suppress(psutil.Error):
        return (process.pid, process.create_time())
    return None


def become_subreaper() -> bool:
    """Orphaned descendants of this process are reparented to it (Linux 3.4+)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    return False


GUARD_MODULE = "det_tasks.runner.trial_guard"


def is_guard(process: psutil.Process) -> bool:
    """Whether ``process`` is a trial guard (ours or a nested runner's): it ignores SIGTERM
    and ends on its own once its runner is gone, so it is never ended as a trial's."""
    with contextlib.suppress(psutil.Error):
        return GUARD_MODULE in process.cmdline()
    return False


def end_processes(processes: Iterable[psutil.Process], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each process, wait up to ``grace_s`` for them, SIGKILL those left, and reap
    the ones that are this process's children; returns the pids that were alive."""
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
            alive.append(process)
    left = _wait_gone(alive, grace_s)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_gone(left, grace_s)
    return [p.pid for p in alive]


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie has: another parent may reap it later);
    reaps this process's own children. Returns those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for process in processes:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(process.pid, os.WNOHANG)  # ours: reaped; else ChildProcessError
        processes = [p for p in processes if _running(p)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.02)


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def mark_what_this_process_starts() -> str:
    """Add this process's mark to ``OWNERS_ENV``, which every process it starts from now on
    inherits (with their own children); returns the mark, for :func:`start_guard`."""
    me = psutil.Process()
    mark = f"{me.pid}-{me.create_time():.3f}"
    owners = [m for m in os.environ.get(OWNERS_ENV, "").split(",") if m]
    os.environ[OWNERS_ENV] = ",".join([*owners, mark])
    return mark


def start_guard(mark: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """Start the guard (``det_tasks.runner.trial_guard``) of this process: once it is gone,
    however it ended, the guard ends what is still running with ``mark``. None, with a
    warning, when it cannot start: what this process started then still ends with it when
    it exits cleanly, just not when it is killed."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", GUARD_MODULE, str(os.getpid()), mark],
            stdin=subprocess.PIPE,
            close_fds=True,
            env=None if env is None else dict(env),
        )
    except OSError as err:
        logger.warning("no guard for this process's processes (%s)", err)
        return None


class TrialProcesses:
    """The processes the trials of this process start, ended with each trial."""

    def __init__(self, guard: subprocess.Popen[bytes] | None = None) -> None:
        self.guard = guard
        self.kept: set[Key] = set()  # descendants that are not the current trial's

    @classmethod
    def start(cls) -> TrialProcesses:
        """Make this process a subreaper, mark what it starts, and start its guard."""
        become_subreaper()
        guard = start_guard(mark_what_this_process_starts())
        processes = cls(guard)
        processes.begin()
        return processes

    def begin(self) -> None:
        """A trial starts: what runs under this process now is not its."""
        self.kept = {k for k in map(_key, self._descendants()) if k is not None}
        self._tell_guard(sorted(self.kept))

    def trials(self) -> list[psutil.Process]:
        """The descendants started since ``begin``: the trial's processes."""
        return [p for p in self._descendants() if _key(p) not in self.kept]

    def end(self, grace_s: float = GRACE_S) -> list[int]:
        """The trial is over: end its processes (returns their pids). Looked for again
        after each round, a few times: one that forked while the others were being ended
        (a child whose parent exits at once, leaving it to this subreaper) was not among
        them yet."""
        ended: list[int] = []
        for _ in range(END_ROUNDS):
            this_round = end_processes(self.trials(), grace_s)
            if not this_round:
                break
            ended += this_round
        self._tell_guard(None)
        return ended

    def close(self) -> None:
        """End the current trial's processes, then the guard."""
        self.end()
        if self.guard is not None:
            with contextlib.suppress(OSError):
                self.guard.kill()
                self.guard.wait()

    def _descendants(self) -> list[psutil.Process]:
        platform = _multiprocessing_helpers()
        with contextlib.suppress(psutil.Error):
            children = psutil.Process().children(recursive=True)
            return [p for p in children if p.pid not in platform and not is_guard(p)]
        return []

    def _tell_guard(self, kept: list[Key] | None) -> None:
        """The guard ends the trial's processes if this process dies: it must know which
        descendants are not the trial's (None: no trial runs, nothing to look at)."""
        if self.guard is None or self.guard.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.guard.stdin.write((json.dumps(kept) + "\n").encode())
            self.guard.stdin.flush()


def _multiprocessing_helpers() -> set[int]:
    """multiprocessing's own long-lived helpers of this process (its resource tracker and
    forkserver): shared by whatever runs here, restarted on demand, never a trial's."""
    pids = set()
    tracker = getattr(multiprocessing, "resource_tracker", None)
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    return pids


@contextlib.contextmanager
def trial_processes() -> Iterator[TrialProcesses]:
    """The trial run inside the block: its processes end when the block does."""
    processes = TrialProcesses.start()
    try:
        yield processes
    finally:
        processes.close()


def own_trial_processes() -> TrialProcesses:
    """This process runs one trial and then exits (``det-tasks run``): the trial's
    processes end as it exits, however it exits (an exception included; ``os._exit`` and
    SIGKILL leave it to the guard)."""
    processes = TrialProcesses.start()
    atexit.register(processes.close)
    return processes
