"""Start a trial's N data-parallel workers: ``torchrun`` or ``horovodrun``, from one config.

``resources.slots_per_trial: N`` with ``resources.distributed_backend: torch | horovod |
auto`` (auto = Horovod when it is installed, else torch.distributed). One worker per GPU
when GPUs exist, else N CPU processes sharing the cores (Gloo). Every worker runs the same
``det-tasks run`` command; the launchers prefix each output line with the rank and stop
every worker when one fails, and this module turns that into one exit code.
Multi-node: ``DET_TASKS_HOSTS="host1:4,host2:4"`` (horovodrun ``-H``) or, for torchrun,
``DET_TASKS_NNODES``/``DET_TASKS_NODE_RANK``/``DET_TASKS_RDZV_ENDPOINT`` on every node.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from det_tasks.cpu_threads import threads_per_process, worker_threads
from det_tasks.errors import ConfigError

__all__ = [
    "inside_worker_group",
    "launch_command",
    "resolve_backend",
    "run_workers",
    "worker_env",
]


def inside_worker_group() -> bool:
    """True in a process that torchrun or horovodrun started."""
    return "HOROVOD_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def worker_rank() -> int:
    return int(os.environ.get("HOROVOD_RANK") or os.environ.get("RANK") or 0)


def resolve_backend(requested: str) -> str:
    """``auto`` -> horovod when importable, else torch; horovod when missing is an error."""
    has_horovod = importlib.util.find_spec("horovod") is not None
    if requested == "auto":
        return "horovod" if has_horovod else "torch"
    if requested == "horovod" and not has_horovod:
        raise ConfigError(
            "resources.distributed_backend is horovod but Horovod is not installed: run "
            "`make horovod` (builds and caches it), or set distributed_backend: torch"
        )
    return requested


def launch_command(
    slots: int, backend: str, worker_argv: Sequence[str], overrides: Sequence[str] = ()
) -> list[str]:
    """The launcher command line that runs ``worker_argv`` (a Python module call) N times.

    ``overrides`` (from a Determined launch layer's ``OVERRIDES... --``) come after our
    options, so torchrun's/horovodrun's last-one-wins parsing lets them replace ours."""
    python = [sys.executable, *worker_argv]
    if backend == "torch":
        nnodes = os.environ.get("DET_TASKS_NNODES", "1")
        if nnodes == "1":
            placement = ["--standalone", "--nnodes", "1"]
        else:
            placement = [
                "--nnodes", nnodes,
                "--node-rank", os.environ.get("DET_TASKS_NODE_RANK", "0"),
                "--rdzv-backend", "c10d",
                "--rdzv-endpoint", os.environ["DET_TASKS_RDZV_ENDPOINT"],
            ]  # fmt: skip
        return [
            sys.executable, "-m", "torch.distributed.run", *placement,
            "--nproc-per-node", str(slots), "--tee", "3", "--role", "rank",
            "--max-restarts", "0", *overrides, "--no-python", *python,
        ]  # fmt: skip
    horovodrun = shutil.which("horovodrun") or os.path.join(
        os.path.dirname(sys.executable), "horovodrun"
    )
    hosts = os.environ.get("DET_TASKS_HOSTS")
    placement = ["-H", hosts] if hosts else []
    return [horovodrun, "-np", str(slots), *placement, "--gloo", *overrides, *python]


def worker_env(slots: int, backend: str) -> dict[str, str]:
    """The environment the workers start with: threads split across them, the backend.
    Inside a warm Dask worker its share of the cores is split (Dask's Nanny set
    OMP_NUM_THREADS=1 for the worker itself, not the user)."""
    env = dict(os.environ)
    share = worker_threads()
    if share is not None:
        env["OMP_NUM_THREADS"] = str(threads_per_process(slots, share))
    else:
        env.setdefault("OMP_NUM_THREADS", str(threads_per_process(slots)))
    env["DET_TASKS_DISTRIBUTED_BACKEND"] = backend
    return env


def run_workers(
    slots: int, backend: str, worker_argv: Sequence[str], overrides: Sequence[str] = ()
) -> int:
    """Run the workers to completion; returns the launcher's exit code (0 = every rank ok).

    Whatever ends this call (the workers, SIGTERM/SIGINT to this process, an exception)
    ends every worker too: horovodrun starts each rank in a process group of its own, so
    the whole process tree is collected first and stopped, not just one group.
    """
    command = launch_command(slots, backend, worker_argv, overrides)
    proc = subprocess.Popen(command, env=worker_env(slots, backend), start_new_session=True)
    restore = _raise_on_termination()
    try:
        return proc.wait()
    except _Terminated as stop:
        return 128 + stop.signum
    finally:
        restore()
        _stop_tree(proc)


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_on_termination() -> Callable[[], None]:
    """Turn SIGTERM/SIGINT, and SIGHUP (a closed terminal) unless it was ignored at start
    (``nohup``), into an exception while waiting, so cleanup runs: the ranks run in a
    session of their own, which a closed terminal's SIGHUP does not reach."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    signals = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in signals}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _stop_tree(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
