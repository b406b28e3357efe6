"""What a Dask worker process does about signals and its own end, apart from the trials it
holds: the process group's SIGINT, SIGTERM and SIGHUP pass it by (the flow stops trials at a batch
boundary itself), and a worker whose trial is stuck in user code can be ended at once."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Any

import psutil
from distributed import Worker

__all__ = ["EXIT_DELAY_S", "exit_soon", "shield_from_group_signals"]

# multiprocessing's name for the process a Dask Nanny starts (distributed.nanny).
_DASK_WORKER_PROCESS = "Dask Worker process (from Nanny)"
_shielded_pid = 0  # the process that called shield_from_group_signals (the forkserver)


def shield_from_group_signals() -> None:
    """Let SIGINT, SIGTERM and SIGHUP pass by this worker process (and the forkserver it
    forks from) while every process a trial starts keeps its normal reaction to them.

    Why: a terminal's Ctrl-C, the SIGHUP of a closed terminal or a dropped ssh session, and
    the SIGTERM that ``timeout``, ``kill -- -PGID``, systemd and Kubernetes send, reach the
    whole process group, embedded workers included; the flow
    decides how its trials stop (checkpoint first) and tells the workers. Dask's Nanny never
    stops a worker by SIGTERM (it asks, then SIGKILLs), and a worker whose Nanny dies exits
    by itself. Ignoring the signals (SIG_IGN) was inherited by the trial's own processes: a
    ``multiprocessing.Pool`` whose ``terminate()`` met a worker still waiting hung for good.
    So a handler decides per process: the shielded ones carry on; any other process that
    inherited it (a forked child: pool and DataLoader workers) acts as it would by default.
    A child that execs gets the default from the kernel. The worker stays in the flow's
    process group, so a SIGKILL of the group still ends every process. Only the main thread
    can install a handler. A SIGHUP ignored at start (``nohup``) stays ignored, and so
    stays ignored in the trial's processes, as it would without the platform."""
    global _shielded_pid
    _shielded_pid = os.getpid()
    with contextlib.suppress(ValueError):  # not the main thread: nothing to change
        signal.signal(signal.SIGINT, _pass_by_workers)
        signal.signal(signal.SIGTERM, _pass_by_workers)
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
            signal.signal(signal.SIGHUP, _pass_by_workers)


def _pass_by_workers(signum: int, frame: Any) -> None:
    if (
        os.getpid() == _shielded_pid
        or multiprocessing.current_process().name == _DASK_WORKER_PROCESS
    ):
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt  # Python's own default for SIGINT
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


EXIT_DELAY_S = 0.2  # long enough for client.run's answer to leave the worker


def exit_soon(*, dask_worker: Worker) -> bool:
    """Kill this worker's child processes now and the worker itself (SIGKILL) a moment
    later (``client.run`` passes ``dask_worker``): the training thread may be stuck where no
    stop request reaches it, so nothing here waits for it."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    timer = threading.Timer(EXIT_DELAY_S, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
    return True
