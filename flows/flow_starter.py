"""The stack's warm flow-run starter: one process that has imported Prefect's engine, the
flows and their MLflow, S3 and Dask clients once, and forks every flow run of the stack's
Prefect worker from that, instead of each flow run importing them again.

Why: on an idle 2-core VM a flow run's own start (an interpreter, Prefect's engine, then
MLflow's client as the experiment begins) was about 3 s of the 5.8 s from
``det experiment create`` to the first trained batch (docs/performance.md). The warm Dask
workers fork from a warm forkserver for the same reason (``cluster.warm_forkserver``).

How a flow run goes through it: the pool's command (``python -m flows.engine_session``, an
interpreter that imports only the standard library) sends its arguments, environment,
working directory, ``sys.path``, the signals it ignores, and its standard streams over
this process's Unix socket (``flows.starter_protocol``). This process forks a *keeper* in
a session of its own, and the keeper forks the flow run:

- the flow run: a session of its own, the command's streams, environment, directory,
  path and signal dispositions, Prefect's settings read again from that environment, the
  guard of what it starts (as ``flows.engine_session`` gives a cold start), then the
  engine module run as ``__main__``, exiting as that interpreter would;
- the keeper: sends the command the flow run's pid (the command forwards the signals it
  gets to it), its exit status once it ends, and SIGKILLs it if the command dies (a
  worker's SIGKILL after its grace: the cold engine would have died with it).

Stopping this process (``make down``) leaves the flow runs it started running, as stopping
the Prefect worker does. It answers only its own user, and refuses (the command then
starts the engine itself) a request from another interpreter or checkout, or once a
source file it imported has changed: it then starts itself again with the new code.

    python -m flows.flow_starter SOCKET
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flows.starter_protocol import (
    STREAMS,
    receive_with_streams,
    send,
)

__all__ = ["PRELOAD", "EngineRequest", "main", "serve", "source_stamp"]

# What an experiment's flow run imports before its first trial starts, in order: Prefect's
# engine, then the flows and what they import lazily (MLflow's client, boto3, Dask's
# client). Not torch: the flow never imports it (it checks a trial's entrypoint from its
# source), and a flow run's exit tears down every module its heap holds (torch: 0.5 s).
PRELOAD = (
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.task_engine",
    "flows.experiment",
    "flows.chains",
    "flows.stopping",
    "flows.trial_table",
    "flows.activation_start",
    "flows.disk_full",
    "cluster.placement",
    "cluster.startup",
    "cluster.steps",
    "registry.runs.tracking",
    "registry.runs.run_states",
    "registry.runs.searcher_state",
    "registry.experiments.packages",
    "registry.experiments.activation",
    "registry.jobs.trial_services",
    "registry.servers.s3",
    "det_tasks.config.entered",
    "det_tasks.runner.trial_processes",
)
_PROJECT = Path(__file__).resolve().parents[1]
_REQUEST_TIMEOUT_S = 5.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Python ignores these at its start; every other catchable signal starts at its default.
_PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)

EngineRequest = dict[str, Any]


def preload() -> list[str]:
    """Import ``PRELOAD``; a module that fails to import here is left to the flow run, which
    reports the error as a cold start would. Returns those that failed."""
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the flow run itself imports it again and says why
            print(f"flow starter: {name} not preloaded: {exc!r}", flush=True)
            failed.append(name)
    return failed


def source_stamp() -> dict[str, int]:
    """The modification times of the project's source files imported so far (not those of
    an environment kept inside the checkout)."""
    stamp = {}
    environments = (sys.prefix + os.sep, sys.base_prefix + os.sep)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.startswith(str(_PROJECT) + os.sep) and not path.startswith(environments):
            with contextlib.suppress(OSError):
                stamp[path] = os.stat(path).st_mtime_ns
    return stamp


def _changed(stamp: dict[str, int]) -> str | None:
    for path, mtime in stamp.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


def _refusal(request: EngineRequest, stamp: dict[str, int]) -> tuple[str, bool] | None:
    """Why this starter cannot run ``request``, and whether it must start again for it."""
    if request.get("executable") != sys.executable:
        why = f"another interpreter ({request.get('executable')}, this one {sys.executable})"
        return why, False
    if request.get("project") != str(_PROJECT):
        return f"another checkout ({request.get('project')}, this one {_PROJECT})", False
    changed = _changed(stamp)
    if changed:
        return f"{changed} changed since this starter imported it", True
    return None


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


@contextlib.contextmanager
def _listening(path: Path) -> Iterator[socket.socket]:
    """The socket, owner-only; removed when the server (not a process it forked) leaves."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = os.getpid()
    try:
        old_umask = os.umask(0o077)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        listener.listen(64)
        yield listener
    finally:
        if os.getpid() == server:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve(path: Path) -> EngineRequest:
    """Answer requests on ``path`` until stopped. Returns only in a forked flow run, with
    the request it is to carry out (``become_engine``)."""
    stamp = source_stamp()
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _stop)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the keepers
    with _listening(path) as listener:
        print(f"flow starter: ready on {path} ({len(stamp)} project files loaded)", flush=True)
        while True:
            conn, _ = listener.accept()
            request = _take(conn, stamp, listener)
            if request is not None:
                return request


def _take(
    conn: socket.socket, stamp: dict[str, int], listener: socket.socket
) -> EngineRequest | None:
    """One request: refused, or a keeper forked for it. Returns the request in the flow run."""
    try:
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return None
        conn.settimeout(_REQUEST_TIMEOUT_S)
        request, fds = receive_with_streams(conn)
        conn.settimeout(None)
    except EOFError:  # a health check: connected, then closed
        conn.close()
        return None
    except (OSError, ValueError) as exc:
        print(f"flow starter: dropped a request: {exc}", flush=True)
        conn.close()
        return None
    refusal = _refusal(request, stamp)
    if refusal is None and os.fork() == 0:
        listener.close()
        return _keep(conn, fds, request)
    for fd in fds:
        os.close(fd)
    if refusal is not None:
        print(f"flow starter: refused a flow run: {refusal[0]}", flush=True)
        with contextlib.suppress(OSError):
            send(conn, {"refused": refusal[0]})
    conn.close()
    if refusal is not None and refusal[1]:
        _restart(listener)
    return None


def _restart(listener: socket.socket) -> None:
    """Start again with the changed code (the socket is made anew)."""
    address = listener.getsockname()
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    sys.stdout.flush()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored SIGCHLD would outlive exec
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _keep(conn: socket.socket, fds: list[int], request: EngineRequest) -> EngineRequest:
    """The keeper: fork the flow run, tell the command its pid and exit status, and end it
    if the command dies first. Returns only in the flow run."""
    try:
        os.setsid()
        for signum in (*_STOP_SIGNALS, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become_engine_or_exit(fds, request)
            return request
        for fd in fds:
            os.close(fd)
        print(f"flow starter: flow run {request.get('flow_run', '?')} is pid {pid}", flush=True)
        _watch(conn, pid)
    except BaseException as exc:  # the keeper never returns to the server's loop
        with contextlib.suppress(BaseException):
            print(f"flow starter: keeper failed: {exc!r}", flush=True)
    os._exit(0)


def _watch(conn: socket.socket, pid: int) -> None:
    try:
        send(conn, {"pid": pid})
    except OSError:
        os.kill(pid, signal.SIGKILL)  # the command is already gone
    selector = selectors.DefaultSelector()
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ)
    ended = False
    while not ended:
        for key, _ in selector.select():
            if key.fileobj == pidfd:
                ended = True
            elif not _command_alive(conn):
                os.kill(pid, signal.SIGKILL)
                selector.unregister(conn)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        send(conn, {"exit": os.waitstatus_to_exitcode(status)})


def _command_alive(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def _become_engine_or_exit(fds: list[int], request: EngineRequest) -> None:
    """``become_engine``, or the reason it could not, on the command's stderr, and exit 1
    (a working directory that is gone, say), as a cold start that failed would."""
    try:
        become_engine(fds, request)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def become_engine(fds: list[int], request: EngineRequest) -> None:
    """Turn this fork into the command's flow run: its session, streams, signals,
    environment, directory, path and arguments, Prefect's settings and the guard."""
    from flows.engine_session import guard_what_this_process_starts

    os.setsid()
    for target, fd in zip(STREAMS, fds, strict=True):
        os.dup2(fd, target)
        if fd not in STREAMS:
            os.close(fd)
    ignored = set(request.get("ignored", []))
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            ignore = signum in ignored or signum in _PYTHON_IGNORES
            signal.signal(signum, signal.SIG_IGN if ignore else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["path"]
    sys.argv = list(request["argv"])
    sys.modules.pop(request["module"], None)  # run as __main__ only, as in a cold start
    _read_settings_again()
    guard_what_this_process_starts()


def _read_settings_again() -> None:
    """What read the environment at import, read again from the flow run's: Prefect's
    settings and its logging levels, and Dask's configuration."""
    context = sys.modules.get("prefect.context")
    if context is not None:
        context.refresh_global_settings_context()
        logging_setup = sys.modules.get("prefect.logging.configuration")
        if logging_setup is not None:
            logging_setup.setup_logging()
    dask_config = sys.modules.get("dask.config")
    if dask_config is not None:
        dask_config.refresh()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m flows.flow_starter SOCKET")
    started = time.monotonic()
    preload()
    print(f"flow starter: imported in {time.monotonic() - started:.1f} s", flush=True)
    request = serve(Path(args[0]))
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
