"""A flow run's process, as the stack's work pool starts it: Prefect's engine, in one
interpreter, in a session of its own, with a guard for what it starts.

Left to itself, Prefect 3.8's process worker starts each flow run as two interpreters one
after the other: its workspace supervisor (``prefect.runner._workspace_supervisor``), which
imports Prefect, runs the deployment's pull step, moves to a session of its own and then
``exec``s ``python -m prefect.engine``, which imports Prefect again (1.1-1.2 s of the time to
the first batch on an idle 2-core VM, docs/performance.md). With a ``command`` in the pool's
job template, the worker starts that command alone, and the engine runs the pull step
itself as it loads the flow; but in the worker's own process group, and a cancel then
signals its pid alone. ``python -m flows.engine_session``, the command ``flows.work_pool``
gives the stack's pool, keeps what the supervisor gave and drops the second start:

- **a session of its own** (``os.setsid``): stopping the worker (``make down``, a SIGTERM
  to its group) does not take the flow runs it started, which wait for the services and
  train on, as they did under the supervisor;
- **what the flow run starts ends with it**: everything it starts carries its mark in the
  environment (``det_tasks.runner.trial_processes``), and a guard process
  (``det_tasks.runner.trial_guard``, the one that ends a killed trial runner's processes)
  ends what is left once this process is gone, by a cancel's SIGTERM, a SIGKILL or a normal
  exit. Under the supervisor, the worker's cancel signalled the whole process group;
- **the engine keeps the worker's pid**: Prefect's engine runs in this very process (as
  ``python -m prefect.engine`` would), so the worker's signals, its control channel and the
  exit status are the engine's, with nothing between them.

The guard gets the environment without Prefect's flow-run variables: the flow run's
process is the one process that carries ``PREFECT__FLOW_RUN_ID``. It watches from its own
start on (an interpreter start, about 0.1 s idle): a flow run killed before that has
started nothing yet that it would have to end.

Where the stack runs its warm starter (``flows.flow_starter``, named by
``DET_TASKS_FLOW_STARTER``), this process imports nothing but the standard library: the
starter forks the flow run, which takes the session and the guard above, from a process
that has Prefect and the flows imported already. The engine's pid is then the forked
one: this process passes on every signal it gets to it (``FORWARDED_SIGNALS``), exits with
its status, or by the same signal, and a SIGKILL here makes the starter's keeper SIGKILL
it. Where the starter does not take the flow run, this process runs the engine itself.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from flows.starter_protocol import (
    FORWARDED_SIGNALS,
    GO,
    PROJECT,
    STARTER_ENV,
    peer_uid,
    process_traits,
    receive,
    send,
    send_with_streams,
)

__all__ = [
    "ENGINE_MODULE",
    "enter_own_session",
    "exit_as",
    "guard_what_this_process_starts",
    "main",
    "start_through_starter",
]

ENGINE_MODULE = "prefect.engine"
# How long the starter may take to fork the flow run before this process starts it itself.
STARTER_ANSWER_S = 10.0


def enter_own_session() -> None:
    """Leave the starter's session and process group; where this process already leads its
    group (started by hand from a shell, which gave it a group of its own), stay in it."""
    with contextlib.suppress(PermissionError):
        os.setsid()


def guard_what_this_process_starts() -> None:
    """Mark what this process starts from now on, and start the guard that ends it once this
    process is gone."""
    from det_tasks.runner.trial_processes import mark_what_this_process_starts, start_guard

    mark = mark_what_this_process_starts()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")}
    start_guard(mark, env)


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.engine_session [MODULE]``: run MODULE (Prefect's engine) as
    ``python -m MODULE`` would, in a session of its own, with a guard: forked by the stack's
    warm starter where it has one (``DET_TASKS_FLOW_STARTER``) and takes it, else here."""
    args = sys.argv[1:] if argv is None else argv
    module = args[0] if args else ENGINE_MODULE
    enter_own_session()
    engine_argv = [sys.argv[0], *args[1:]]
    starter = os.environ.get(STARTER_ENV)
    if starter:
        code = start_through_starter(Path(starter), module, engine_argv)
        if code is not None:
            exit_as(code)
    guard_what_this_process_starts()
    sys.argv = engine_argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _ignored_signals() -> list[int]:
    ignored = []
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(signum) == signal.SIG_IGN:
                ignored.append(int(signum))
    return ignored


def _request(module: str, argv: list[str]) -> dict[str, Any]:
    """What the starter needs to fork the flow run this process would have run."""
    return {
        "executable": sys.executable,
        "project": str(PROJECT),
        "module": module,
        "argv": argv,
        "path": sys.path,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "ignored": _ignored_signals(),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "traits": process_traits(),
        "flow_run": os.environ.get("PREFECT__FLOW_RUN_ID", "?"),
    }


def start_through_starter(path: Path, module: str, argv: list[str]) -> int | None:
    """Have the starter on ``path`` fork the flow run (``module`` as ``__main__`` with
    ``argv``), pass it the signals this process gets, and return its exit code once it ends;
    None, with nothing started, where the starter does not take it."""
    request = _request(module, argv)
    target: list[int] = []  # the flow run's pidfd, once the starter names it
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if not target:
            pending.append(signum)
            return
        with contextlib.suppress(OSError):  # it has ended (its pidfd outlives its pid)
            signal.pidfd_send_signal(target[0], signum)

    previous = {
        signum: signal.signal(signum, forward)
        for signum in FORWARDED_SIGNALS
        if signum not in request["ignored"]
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(STARTER_ANSWER_S)
        try:
            sock.connect(str(path))
            if peer_uid(sock) != os.getuid():
                raise ConnectionRefusedError(f"it runs as user {peer_uid(sock)}, not this one")
            send_with_streams(sock, request)
            reply = receive(sock)
            if reply and "pid" in reply:
                pidfd = _pidfd(int(reply["pid"]))
                try:
                    send(sock, GO)  # from here the flow run is the starter's
                except OSError:
                    if pidfd >= 0:
                        os.close(pidfd)
                    raise
                target.append(pidfd)
        except (OSError, EOFError, ValueError) as exc:
            reply = {"refused": f"no answer from {path} ({exc})"}
        if not target:
            why = (reply or {}).get("refused", "it closed the connection")
            print(f"flow starter not used ({why}); starting the engine here", file=sys.stderr)
            for forwarded, handler in previous.items():
                signal.signal(forwarded, handler)
            for waiting in pending:
                os.kill(os.getpid(), waiting)
            return None
        for waiting in pending:
            forward(waiting, None)
        return _outcome(sock, target[0])


def _outcome(sock: socket.socket, pidfd: int) -> int:
    """The flow run's exit code, as its keeper sends it; 1 once the flow run has ended
    where the keeper died first."""
    sock.settimeout(None)
    try:
        outcome = receive(sock)
    except (OSError, EOFError, ValueError):
        outcome = None
    if outcome is None or "exit" not in outcome:
        _wait_gone(pidfd)
        return 1
    return int(outcome["exit"])


def _pidfd(pid: int) -> int:
    """A handle on the flow run that a reused pid cannot fool; -1 once it has already
    ended (the keeper still sends how)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


def _wait_gone(pidfd: int) -> None:
    if pidfd >= 0:
        select.select([pidfd], [], [])


def exit_as(code: int) -> None:
    """Exit as the flow run did: with its code, or killed by the same signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
