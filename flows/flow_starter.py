"""The stack's warm flow-run starter: one process that has imported Prefect's engine, the
flows and their MLflow, S3 and Dask clients once, and forks every flow run of the stack's
Prefect worker from that, instead of each flow run importing them again.

Why: on an idle 2-core VM a flow run's own start (an interpreter, Prefect's engine, then
MLflow's client as the experiment begins) was about 3 s of the 5.8 s from
``det experiment create`` to the first trained batch (docs/performance.md). The warm Dask
workers fork from a warm forkserver for the same reason (``cluster.warm_forkserver``).

How a flow run goes through it: the pool's command (``python -m flows.engine_session``, an
interpreter that imports only the standard library) sends its arguments, environment,
working directory, ``sys.path``, signal dispositions and mask, its process traits
(``starter_protocol.process_traits``) and its standard streams over this process's Unix
socket (``flows.starter_protocol``). This process forks a *keeper* in a session of its
own, and the keeper forks the flow run:

- the flow run: a session of its own, the command's streams (buffered as the command's
  would be), environment (with the defaults this process's imports set), directory, path,
  signal dispositions and mask, Prefect's settings and logging and Dask's configuration
  read again from that environment, the guard of what it starts (as
  ``flows.engine_session`` gives a cold start), then the engine module run as
  ``__main__``, exiting as that interpreter would. The forwarded signals stay blocked
  until then: one sent while it starts is delivered, not lost;
- the keeper: sends the command the flow run's pid, and lets the flow run start only once
  the command answers that it takes it (a command that gave up waiting has started the
  engine itself, and the unstarted fork is killed: a flow run never runs twice). Then it
  sends the command the flow run's exit status once it ends, and SIGKILLs it if the
  command dies (a worker's SIGKILL after its grace: the cold engine would have died with
  it). The command forwards the signals it gets to the flow run.

Stopping this process (``make down``) leaves the flow runs it started running, as stopping
the Prefect worker does. It answers only its own user, through a socket in a folder only
that user can open, and refuses (the command then starts the engine itself) a command of
another interpreter or checkout or with other traits, or once a file it imported (the
platform's or an installed package's) has changed: it then starts itself again, with
the new code. What it forked shows in ``ps`` as ``python -m flows.flow_starter``.

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
import stat
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from flows.starter_protocol import (
    FORWARDED_SIGNALS,
    GO,
    PROJECT,
    STREAMS,
    peer_uid,
    process_traits,
    receive,
    receive_with_streams,
    send,
)

__all__ = ["PRELOAD", "EngineRequest", "become_engine", "main", "preload", "serve", "source_stamp"]

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
_REQUEST_TIMEOUT_S = 5.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Python ignores these at its start; every other catchable signal starts at its default.
_PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)

EngineRequest = dict[str, Any]


class _Starter:
    """What the serving process knows of itself: what its imports put in the environment,
    the files it imported and when, and its traits."""

    def __init__(self, env_before: dict[str, str], started_ns: int) -> None:
        self.env_defaults = {k: v for k, v in os.environ.items() if k not in env_before}
        self.stamp = source_stamp(started_ns)
        self.traits = process_traits()


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


def source_stamp(started_ns: int = 0) -> dict[str, int]:
    """The modification times of every file imported so far, the platform's and the
    installed packages'; a file changed after ``started_ns`` (while this process imported
    it) is recorded as changed already (one dated in the future, a skewed clock, is not)."""
    stamp = {}
    now = time.time_ns()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        with contextlib.suppress(OSError):
            mtime = os.stat(path).st_mtime_ns
            stamp[path] = 0 if started_ns < mtime <= now and started_ns else mtime
    return stamp


def _changed(stamp: dict[str, int]) -> str | None:
    for path, mtime in stamp.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


def _refusal(request: EngineRequest, starter: _Starter) -> tuple[str, bool] | None:
    """Why this starter cannot run ``request``, and whether it must start again for it."""
    if request.get("executable") != sys.executable:
        why = f"another interpreter ({request.get('executable')}, this one {sys.executable})"
        return why, False
    if request.get("project") != str(PROJECT):
        return f"another checkout ({request.get('project')}, this one {PROJECT})", False
    theirs = request.get("traits")
    if not isinstance(theirs, dict):
        return "a request without the command's traits (an older command?)", False
    for trait, ours in starter.traits.items():
        if theirs.get(trait) != ours:
            return f"the command's {trait}: not this starter's", False
    changed = _changed(starter.stamp)
    if changed:
        return f"{changed} changed since this starter imported it", True
    return None


def _private_folder(folder: Path) -> None:
    """``folder``, made if missing, must be this user's alone: a socket in a folder that
    another user can write to could be replaced by theirs."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SystemExit(
            f"flow starter: {folder} must be a folder of this user's (uid {os.getuid()}) that "
            f"no one else can open (mode 0700); it is not. Remove it, or give "
            f"`python -m flows.flow_starter` a socket path in a folder of your own."
        )


@contextlib.contextmanager
def _listening(path: Path) -> Iterator[socket.socket]:
    """The socket, owner-only, in a private folder; removed when the server (not a process
    it forked) leaves, unless another starter has taken the path since."""
    _private_folder(path.parent)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = os.getpid()
    inode = None
    try:
        old_umask = os.umask(0o077)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        inode = os.stat(path).st_ino
        listener.listen(64)
        yield listener
    finally:
        if os.getpid() == server:
            listener.close()
            _unlink_if(path, inode)


def _unlink_if(path: Path | str, inode: int | None) -> None:
    with contextlib.suppress(FileNotFoundError):
        if inode is not None and os.stat(path).st_ino == inode:
            os.unlink(path)


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _reap_children() -> None:
    """Keepers that ended before this process (started again by ``_restart``) ignored
    SIGCHLD are zombies of it; ignoring SIGCHLD later would not reap them."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def serve(path: Path, starter: _Starter) -> EngineRequest:
    """Answer requests on ``path`` until stopped. Returns only in a forked flow run, with
    the request it is to carry out (``become_engine``)."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _stop)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the keepers
    _reap_children()
    with _listening(path) as listener:
        print(
            f"flow starter: ready on {path} ({len(starter.stamp)} files imported; "
            f"variables their imports set: {sorted(starter.env_defaults) or 'none'})",
            flush=True,
        )
        while True:
            conn, _ = listener.accept()
            request = _take(conn, starter, listener)
            if request is not None:
                return request


def _take(conn: socket.socket, starter: _Starter, listener: socket.socket) -> EngineRequest | None:
    """One request: refused, or a keeper forked for it. Returns the request in the flow run."""
    try:
        if peer_uid(conn) != os.getuid():
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
    refusal = _refusal(request, starter)
    if refusal is None:
        try:
            if os.fork() == 0:
                listener.close()
                return _keep(conn, fds, request, starter)
        except OSError as exc:
            refusal = f"could not fork the flow run ({exc})", False
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
    inode = os.stat(address).st_ino
    listener.close()
    _unlink_if(address, inode)
    sys.stdout.flush()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored SIGCHLD would outlive exec
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _keep(
    conn: socket.socket, fds: list[int], request: EngineRequest, starter: _Starter
) -> EngineRequest:
    """The keeper: fork the flow run, tell the command its pid and exit status, and end it
    if the command dies first. Returns only in the flow run, with the forwarded signals
    still blocked (``main`` unblocks them as the engine starts)."""
    try:
        os.setsid()
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        go_read, go_write = os.pipe()
        pid = os.fork()
    except BaseException as exc:  # the keeper never returns to the server's loop
        _keeper_failed(exc)
    if pid == 0:
        conn.close()
        os.close(go_write)
        _wait_for_go(go_read)
        _become_engine_or_exit(fds, request, starter.env_defaults)
        return request
    try:
        os.close(go_read)
        for fd in fds:
            os.close(fd)
        print(f"flow starter: flow run {request.get('flow_run', '?')} is pid {pid}", flush=True)
        if _command_says_go(conn, pid):
            with contextlib.suppress(OSError):  # killed while it waited: _watch sees it end
                os.write(go_write, b"g")
            os.close(go_write)
            _watch(conn, pid)
        else:
            print(
                f"flow starter: pid {pid} ended unstarted: its command went on without it",
                flush=True,
            )
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except BaseException as exc:
        _keeper_failed(exc)
    os._exit(0)


def _wait_for_go(go_read: int) -> None:
    """Run nothing of the flow run until its command has taken it: a command that gave up
    waiting for the starter runs the engine itself, and one flow run must not run twice."""
    if os.read(go_read, 1) != b"g":
        os._exit(1)  # the keeper ended without a go
    os.close(go_read)


def _command_says_go(conn: socket.socket, pid: int) -> bool:
    """Name the flow run to its command and wait for the command to take it."""
    try:
        send(conn, {"pid": pid})
        return receive(conn) == GO
    except (OSError, EOFError, ValueError):
        return False


def _keeper_failed(exc: BaseException) -> NoReturn:
    with contextlib.suppress(BaseException):
        print(f"flow starter: keeper failed: {exc!r}", flush=True)
    os._exit(1)


def _watch(conn: socket.socket, pid: int) -> None:
    """Send the command the flow run's exit status; end the flow run if the command dies."""
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


def _become_engine_or_exit(
    fds: list[int], request: EngineRequest, env_defaults: dict[str, str]
) -> None:
    """``become_engine``, or the reason it could not, on the command's stderr, and exit 1
    (a working directory that is gone, say), as a cold start that failed would."""
    try:
        become_engine(fds, request, env_defaults)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def become_engine(
    fds: list[int], request: EngineRequest, env_defaults: dict[str, str] | None = None
) -> None:
    """Turn this fork into the command's flow run: its session, streams, signal
    dispositions, environment (with ``env_defaults`` where it has none of its own: what
    this process's imports set), directory, path and arguments, what read the environment
    at import, and the guard. The signal mask is ``main``'s to set."""
    from flows.engine_session import guard_what_this_process_starts

    os.setsid()
    for target, fd in zip(STREAMS, fds, strict=True):
        os.dup2(fd, target)
        if fd not in STREAMS:
            os.close(fd)
    _set_dispositions(set(request.get("ignored", [])))
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in (env_defaults or {}).items():
        os.environ.setdefault(name, value)
    time.tzset()
    _buffer_streams_as_the_command()
    os.chdir(request["cwd"])
    sys.path[:] = request["path"]
    sys.argv = list(request["argv"])
    sys.modules.pop(request["module"], None)  # run as __main__ only, as in a cold start
    _read_settings_again()
    guard_what_this_process_starts()


def _set_dispositions(ignored: set[int]) -> None:
    """The dispositions an interpreter started by the command would have: what the
    command ignores stays ignored, Python's own start-up choices, the rest the default."""
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            ignore = signum in ignored or signum in _PYTHON_IGNORES
            signal.signal(signum, signal.SIG_IGN if ignore else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _buffer_streams_as_the_command() -> None:
    """stdout line-buffered on a terminal, block-buffered elsewhere; both written through
    with ``PYTHONUNBUFFERED``: as the interpreter sets them at its start."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.reconfigure(write_through=unbuffered)  # type: ignore[union-attr]
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]


def _read_settings_again() -> None:
    """What read the environment at import, read again from the flow run's: Prefect's
    settings and its whole logging set-up, and Dask's configuration."""
    context = sys.modules.get("prefect.context")
    if context is not None:
        context.refresh_global_settings_context()
        logging_setup = sys.modules.get("prefect.logging.configuration")
        if logging_setup is not None:
            logging_setup.setup_logging(incremental=False)
    dask_config = sys.modules.get("dask.config")
    if dask_config is not None:
        dask_config.refresh()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m flows.flow_starter SOCKET")
    env_before = dict(os.environ)
    started_ns = time.time_ns()
    preload()
    starter = _Starter(env_before, started_ns)
    print(f"flow starter: imported in {(time.time_ns() - started_ns) / 1e9:.1f} s", flush=True)
    request = serve(Path(args[0]), starter)
    # The flow run, set up: the signals a command sent while it started are delivered now.
    signal.pthread_sigmask(signal.SIG_SETMASK, request.get("blocked", []))
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
