"""Background services with pid files, log files, health checks and clean process-group stops.

Each service runs in its own session (process group) so stopping it also stops the
children it spawned (MLflow's uvicorn workers, SeaweedFS's sub-servers): nothing is orphaned.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pwd
import signal
import socket
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
    "port_holder",
    "port_open",
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
    # The signal that asks for its graceful stop (PostgreSQL's clean "fast" stop is SIGINT).
    stop_signal: int = signal.SIGTERM
    # True once a signalled service has done all its graceful stop does while its process
    # lingers on a wait that writes nothing: the stop KILLs it then, not at stop_timeout_s.
    stop_done: Callable[[], bool] | None = None
    # Run as this user (the process itself, no wrapper: a `runuser` in between slept 2 s
    # on every stop, then SIGKILLed its child whether or not it had finished stopping).
    user: str | None = None

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


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host``:``port`` now."""
    with socket.socket() as sock:
        sock.settimeout(timeout)
        return sock.connect_ex((host, port)) == 0


def port_holder(port: int) -> str:
    """ " (held by pid N: its command)" for the process listening on ``port``, or "" when
    none can be named (another user's, another network namespace's): what a refused
    start says, so the user knows what to stop."""
    import psutil

    try:
        listening = [
            c
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ]
    except (psutil.Error, OSError):
        return ""
    for conn in listening:
        try:
            command = " ".join(" ".join(psutil.Process(conn.pid).cmdline()).split())[:200]
        except psutil.Error:
            continue
        return f" (held by pid {conn.pid}: {command})"
    return ""


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
        # The leader exited but its group lives on (a wrapper shell killed alone, its
        # servers still listening): the group is still the service's, and stopping it
        # must reach them, or its ports stay taken for the next start.
        return pid if _live_member(pid) else None
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
            **_as_user(service.user),
        )
    service.pidfile.write_text(str(proc.pid))
    return proc, time.monotonic() + service.start_timeout_s


def _await_healthy(service: Service, launched: tuple[subprocess.Popen[bytes], float]) -> None:
    """Until ``service`` is healthy. Looked at once at least, however late: its deadline may
    have passed while an earlier service was awaited (a loaded host), and a scheduler that
    had long been up was then stopped as "not healthy"."""
    proc, deadline = launched
    while True:
        if proc.poll() is not None:
            service.pidfile.unlink(missing_ok=True)
            raise ServiceError(
                f"{service.name} exited with code {proc.returncode} while starting; "
                f"log {service.logfile}:\n{_tail(service.logfile)}"
            )
        if service.healthy():
            return
        if time.monotonic() >= deadline:
            break
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
    """Stop ``services`` side by side: signal every group at once (``stop_signal``), then
    return as soon as each is gone, KILLing a group still alive past its own
    ``stop_timeout_s`` (or once its ``stop_done`` says the rest is an idle wait); for each,
    True if one was running."""
    leaders = [_leader(service) for service in services]
    stopping: list[tuple[Service, int, float]] = []
    for service, leader in zip(services, leaders, strict=True):
        if leader is None:
            service.pidfile.unlink(missing_ok=True)
            continue
        _signal_group(leader, service.stop_signal)  # a leader's pid is its group's id
        stopping.append((service, leader, time.monotonic() + service.stop_timeout_s))
    while stopping:
        stopping = [s for s in stopping if not _stopped_or_killed(*s)]
        if stopping:
            time.sleep(0.1)
    return [leader is not None for leader in leaders]


def _stopped_or_killed(service: Service, leader: int, deadline: float) -> bool:
    """One look at a signalled group: True once it is gone (KILLed if it is due)."""
    if _group_alive(leader):
        if service.stop_done is not None and service.stop_done():
            _logger.info("%s finished its graceful stop; killing what lingers", service.name)
        elif time.monotonic() >= deadline:
            _logger.warning(
                "%s did not stop within %.0f s of %s; killing it (log: %s)",
                service.name,
                service.stop_timeout_s,
                signal.Signals(service.stop_signal).name,
                service.logfile,
            )
        else:
            return False
        _kill_group(leader)
    service.pidfile.unlink(missing_ok=True)
    return True


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


def _as_user(user: str | None) -> dict[str, Any]:
    """Popen's arguments that run the process as ``user``, with its own group and none of
    this process's supplementary groups."""
    if user is None:
        return {}
    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


KILLED_GONE_WITHIN_S = 30.0  # a KILLed group's exit under load; it cannot refuse


def _kill_group(leader: int) -> None:
    """KILL the group and wait until it is gone: a service's ports are free only then. A
    KILLed process cannot refuse, but on a loaded host one with many threads took more
    than the 5 s once allowed here to finish exiting."""
    _signal_group(leader, signal.SIGKILL)
    deadline = time.monotonic() + KILLED_GONE_WITHIN_S
    while _group_alive(leader):
        if time.monotonic() >= deadline:
            _logger.warning(
                "process group %d still exiting %.0f s after SIGKILL", leader, KILLED_GONE_WITHIN_S
            )
            return
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(leader: int) -> bool:
    """Whether a process of the group ``leader`` leads is still running (zombies, which
    have exited and wait only to be reaped, are not)."""
    _reap(leader)  # a leader we started is a zombie until reaped, and still "in" the group
    try:
        os.killpg(leader, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _live_member(leader)


def _live_member(pgid: int) -> bool:
    """Whether a process of group ``pgid`` has yet to exit. A zombie has exited: it only
    waits for its parent (init, for an orphan) to reap it, which took up to 1.3 s per
    stop on these machines; without /proc, every member counts."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        state, _ppid, group = text[text.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and (state != "Z" or _threads_live(stat.parent)):
            return True
    return False


def _threads_live(process: Path) -> bool:
    """Whether a process whose main thread is a zombie still has a thread running. A
    multi-threaded server (SeaweedFS's Go parts, uvicorn) SIGKILLed under load shows "Z"
    for its main thread while its other threads are still exiting, and they hold its
    open files, listening sockets included, until the last one is gone: a stop that
    took "Z" for gone returned with the service's ports still taken, and the next
    start was refused (CI, stop 55)."""
    for task in process.glob("task/[0-9]*/stat"):
        try:
            text = task.read_text()
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            return True
    return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
