"""Background services with pid files, log files, health checks and clean process-group stops.

Each service runs in its own session (process group) so stopping it also stops the
children it spawned (MLflow's uvicorn workers, SeaweedFS's sub-servers): nothing is orphaned.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)

__all__ = [
    "Service",
    "ServiceError",
    "http_ok",
    "is_running",
    "kept_secrets",
    "start",
    "start_all",
    "state_lines",
    "stop",
    "stop_all",
    "up_or_down",
]


class ServiceError(RuntimeError):
    """A service did not come up (or down) in time; the message carries its log's tail."""


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]
    root: Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 20.0
    cwd: Path | None = None  # working directory of the process (default: inherited)
    # Variables the service must not have, whether inherited or in ``env``.
    unset: tuple[str, ...] = ()

    @property
    def pidfile(self) -> Path:
        return self.root / "pids" / f"{self.name}.pid"

    @property
    def logfile(self) -> Path:
        return self.root / "logs" / f"{self.name}.log"


def kept_secrets(path: Path, generate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Secrets generated once per stack directory and kept in ``path`` (JSON, mode 0600,
    never wider even for a moment); later calls read them back."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(json.dumps(generate()))
    return dict(json.loads(path.read_text()))


def http_ok(url: str, timeout: float = 2.0, expect_status: int | None = 200) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return expect_status is None or resp.status == expect_status
    except urllib.error.HTTPError as err:
        return expect_status is None or err.code == expect_status
    except (OSError, ValueError):
        return False


def _read_pid(service: Service) -> int | None:
    try:
        return int(service.pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _leader(service: Service) -> int | None:
    """The recorded pid while it still leads its own process group, as every service
    started here does (its own session); else None. A pid file that outlived its process
    (a reboot, a crash) may name an unrelated process by now: never signal that one."""
    pid = _read_pid(service)
    if pid is None:
        return None
    try:
        return pid if os.getpgid(pid) == pid else None
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, and not ours to check; treated as not this service
        return None


def is_running(service: Service) -> bool:
    return _leader(service) is not None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def start(service: Service) -> bool:
    """Start unless already running and healthy; returns True if it started it now."""
    return start_all([service])[0]


def start_all(services: Sequence[Service]) -> list[bool]:
    """Start ``services`` side by side (none waits for another's health check) unless
    already running and healthy; for each, True if it started it now. Only for services
    that do not need each other to come up, or that wait for what they need (a Dask worker
    retries its scheduler until it answers). On a failure the ones started here are left
    running, as ``start`` leaves earlier services: the caller's stop cleans up."""
    launched = [_launch(service) for service in services]
    for service, proc in zip(services, launched, strict=True):
        if proc is not None:
            _await_healthy(service, proc)
    return [proc is not None for proc in launched]


def _launch(service: Service) -> tuple[subprocess.Popen[bytes], float] | None:
    """The process and its health deadline, or None when it already runs and is healthy."""
    if is_running(service) and service.healthy():
        return None
    if is_running(service):
        stop(service)
    service.pidfile.parent.mkdir(parents=True, exist_ok=True)
    service.logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(service.logfile, "ab") as log:
        proc = subprocess.Popen(
            service.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_environment(service),
            cwd=service.cwd,
            start_new_session=True,
        )
    service.pidfile.write_text(str(proc.pid))
    return proc, time.monotonic() + service.start_timeout_s


def _await_healthy(service: Service, launched: tuple[subprocess.Popen[bytes], float]) -> None:
    proc, deadline = launched
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            service.pidfile.unlink(missing_ok=True)
            raise ServiceError(
                f"{service.name} exited with code {proc.returncode} while starting; "
                f"log {service.logfile}:\n{_tail(service.logfile)}"
            )
        if service.healthy():
            return
        time.sleep(0.3)
    stop(service)
    raise ServiceError(
        f"{service.name} was not healthy within {service.start_timeout_s:.0f}s; "
        f"log {service.logfile}:\n{_tail(service.logfile)}"
    )


def stop(service: Service) -> bool:
    """Stop the service's whole process group (TERM, then KILL); True if one was running."""
    return stop_all([service])[0]


def stop_all(services: Sequence[Service]) -> list[bool]:
    """Stop ``services`` side by side: TERM every group at once, then KILL each group still
    alive past its own ``stop_timeout_s``; for each, True if one was running."""
    leaders = [_leader(service) for service in services]
    stopping: list[tuple[Service, int, float]] = []
    for service, leader in zip(services, leaders, strict=True):
        if leader is None:
            service.pidfile.unlink(missing_ok=True)
            continue
        _signal_group(leader, signal.SIGTERM)  # a leader's pid is its group's id
        stopping.append((service, leader, time.monotonic() + service.stop_timeout_s))
    while stopping:
        still = []
        for service, leader, deadline in stopping:
            if not _group_alive(leader):
                service.pidfile.unlink(missing_ok=True)
            elif time.monotonic() >= deadline:
                _logger.warning(
                    "%s did not stop within %.0f s of SIGTERM; killing it (log: %s)",
                    service.name,
                    service.stop_timeout_s,
                    service.logfile,
                )
                _kill_group(leader)
                service.pidfile.unlink(missing_ok=True)
            else:
                still.append((service, leader, deadline))
        stopping = still
        if stopping:
            time.sleep(0.2)
    return [leader is not None for leader in leaders]


def up_or_down(services: Sequence[Service]) -> list[tuple[Service, str]]:
    """Each service with "up" (its process runs and its health check passes) or "down"."""
    return [(s, "up" if is_running(s) and s.healthy() else "down") for s in services]


def state_lines(states: Sequence[tuple[Service, str]]) -> list[str]:
    """What a ``status`` command prints: one line per service, with its log."""
    return [f"{service.name:16s} {state:5s} log: {service.logfile}" for service, state in states]


def _environment(service: Service) -> dict[str, str]:
    """This process's environment with the service's own added, less what it unsets."""
    merged = {**os.environ, **service.env}
    return {k: v for k, v in merged.items() if k not in service.unset}


def _kill_group(leader: int) -> None:
    _signal_group(leader, signal.SIGKILL)
    for _ in range(50):
        if not _group_alive(leader):
            return
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(leader: int) -> bool:
    _reap(leader)  # a leader we started is a zombie until reaped, and still "in" the group
    try:
        os.killpg(leader, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
