"""The stack's warm flow-run starter (``flows.flow_starter``) and the pool's command that
uses it (``python -m flows.engine_session`` with ``DET_TASKS_FLOW_STARTER``): real
processes, a real starter that has imported Prefect, and a stand-in for Prefect's engine
that starts a helper and reports what it sees."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from flows.flow_starter import _changed, source_stamp
from flows.starter_protocol import (
    STARTER_ENV,
    receive,
    receive_with_streams,
    send,
    send_with_streams,
    socket_path,
)
from tests.integration.helpers import REPO, wait_for

STANDIN = textwrap.dedent(
    """
    import json, logging, os, signal, subprocess, sys, time
    marker, report, mode = sys.argv[1:]
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", marker]
    subprocess.Popen(sleeper)
    print("standin says hello", flush=True)
    warm = "prefect.engine" in sys.modules and "mlflow" in sys.modules
    seen = {"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgrp(),
            "name": __name__, "spec": __spec__.name, "argv": sys.argv, "cwd": os.getcwd(),
            "path": sys.path, "value": os.environ.get("STANDIN_VALUE"),
            "telemetry": os.environ.get("MLFLOW_DISABLE_TELEMETRY"),
            "hup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
            "int_handler": signal.getsignal(signal.SIGINT) == signal.default_int_handler,
            "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "stdout_line_buffered": sys.stdout.line_buffering, "warm": warm}
    if warm:  # what Prefect read from the environment at import, read again
        from prefect.settings import get_current_settings
        seen["api_url"] = get_current_settings().api.url
        seen["prefect_level"] = logging.getLogger("prefect").level
    with open(report + ".tmp", "w") as f:
        json.dump(seen, f)
    os.rename(report + ".tmp", report)
    if mode == "exit":
        raise SystemExit(3)
    time.sleep(1000)
    """
)


@dataclass
class Starter:
    root: Path  # the stand-in's folder, on the PYTHONPATH the starter and commands share
    socket: Path
    process: subprocess.Popen[bytes]

    @property
    def log(self) -> str:
        return (self.root / "starter.log").read_text()


def _pythonpath(root: Path) -> str:
    return os.pathsep.join([str(root), str(REPO)])


def _start_starter(root: Path) -> Starter:
    """A starter as the stack starts one, with the environment its commands will have."""
    (root / "engine_standin.py").write_text(STANDIN)
    path = socket_path(root)
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.flow_starter", str(path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": _pythonpath(root)},
        stdout=open(root / "starter.log", "ab"),  # noqa: SIM115 -- the child keeps it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for(lambda: "ready on" in (root / "starter.log").read_text(), 120, "the starter")
    return Starter(root, path, process)


def _stop_starter(starter: Starter) -> None:
    if starter.process.poll() is None:
        os.killpg(starter.process.pid, signal.SIGTERM)
        starter.process.wait(timeout=30)


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Starter]:
    started = _start_starter(tmp_path_factory.mktemp("starter"))
    try:
        yield started
    finally:
        _stop_starter(started)


def _marked(marker: str) -> list[psutil.Process]:
    """The stand-in's helper (not the command, whose arguments name the marker too)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if (
            marker in cmdline
            and "flows.engine_session" not in cmdline
            and process.info["status"] != psutil.STATUS_ZOMBIE
            and not any(part.endswith("engine_standin.py") for part in cmdline)
        ):
            found.append(process)
    return found


def _command(
    tmp_path: Path,
    starter: Starter | Path,
    mode: str,
    executable: str = sys.executable,
    env: dict[str, str] | None = None,
    **popen: object,
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """The pool's command, with the stand-in for the engine; ``starter`` a running one, or a
    socket path nobody answers on."""
    root = starter.root if isinstance(starter, Starter) else tmp_path
    (root / "engine_standin.py").write_text(STANDIN)
    marker = f"flow-starter-{uuid.uuid4().hex}"
    report = tmp_path / f"seen-{marker}.json"
    command_env = {
        **os.environ,
        "PYTHONPATH": _pythonpath(root),
        "PREFECT__FLOW_RUN_ID": marker,
        "STANDIN_VALUE": "from the command",
        STARTER_ENV: str(starter.socket if isinstance(starter, Starter) else starter),
        **(env or {}),
    }
    argv = [executable, "-m", "flows.engine_session", "engine_standin", marker, str(report), mode]
    command = subprocess.Popen(argv, env=command_env, cwd=tmp_path, **popen)  # type: ignore[call-overload]
    return command, marker, report


def _seen(report: Path) -> dict:
    return json.loads(wait_for(lambda: report.exists() and report.read_text(), 60, "the report"))


def _cleanup(command: subprocess.Popen[bytes], marker: str, seen_pid: int | None) -> None:
    """What a failed test left: the helper, the flow run, the command."""
    for process in _marked(marker):
        process.kill()
    if seen_pid and psutil.pid_exists(seen_pid):
        os.kill(seen_pid, signal.SIGKILL)
    if command.poll() is None:
        command.kill()


def _other_name_of_this_interpreter() -> Path:
    here = Path(sys.executable)
    for name in ("python3", "python", f"python3.{sys.version_info.minor}"):
        if name != here.name and here.with_name(name).exists():
            return here.with_name(name)
    pytest.skip(f"no other name for {sys.executable} in its folder")


def test_the_starter_forks_the_flow_run_warm_with_the_commands_streams_and_settings(
    tmp_path: Path, starter: Starter
) -> None:
    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup

    command, marker, report = _command(
        tmp_path,
        starter,
        "exit",
        env={"PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_LOGGING_LEVEL": "DEBUG"},
        stdout=subprocess.PIPE,
        preexec_fn=ignore_hangup,
    )
    out, _ = command.communicate(timeout=60)
    seen = _seen(report)
    assert command.returncode == 3  # the engine's exit status is the command's
    assert b"standin says hello" in out  # written to the command's own stdout
    assert seen["warm"]  # Prefect's engine and MLflow were imported before it started
    assert f"flow run {marker} is pid {seen['pid']}" in starter.log
    assert seen["pid"] != command.pid
    assert seen["sid"] == seen["pid"] == seen["pgid"]  # a session of its own
    assert seen["name"] == "__main__" and seen["spec"] == "engine_standin"
    assert seen["argv"] == [str(starter.root / "engine_standin.py"), marker, str(report), "exit"]
    assert seen["cwd"] == str(tmp_path) and str(tmp_path) in seen["path"]
    assert seen["value"] == "from the command"
    assert seen["hup_ignored"] and seen["int_handler"] and seen["blocked"] == []
    assert not seen["stdout_line_buffered"]  # a pipe, as a cold interpreter's stdout
    # What Prefect read at import, read again from the command's environment; what the
    # starter's imports set as defaults (registry's telemetry opt-out) is there too.
    assert seen["api_url"] == "http://127.0.0.1:9/api"
    assert seen["prefect_level"] == 10  # logging.DEBUG
    assert seen["telemetry"] == "true"
    wait_for(lambda: not _marked(marker), 15, "the guard to end the helper it left")


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, "group"]
)
def test_a_signal_to_the_command_reaches_the_flow_run(
    tmp_path: Path, starter: Starter, signum: int | str
) -> None:
    command, marker, report = _command(tmp_path, starter, "block")
    seen_pid = None
    try:
        seen_pid = _seen(report)["pid"]
        wait_for(lambda: len(_marked(marker)) == 1, 30, "the helper")
        if isinstance(signum, str):  # "group": the command's whole process group
            os.killpg(command.pid, signal.SIGTERM)
            sent: int = signal.SIGTERM
        else:
            command.send_signal(signum)
            sent = signum
        # The flow run ended by it (SIGINT: Python's KeyboardInterrupt, which ends the
        # interpreter by SIGINT), and the command with the same status, as a cold engine.
        assert command.wait(timeout=30) == -sent
        assert not psutil.pid_exists(seen_pid)
        wait_for(lambda: not _marked(marker), 15, "the helper to end")
    finally:
        _cleanup(command, marker, seen_pid)


def test_a_signal_sent_while_the_flow_run_starts_is_not_lost(
    tmp_path: Path, starter: Starter
) -> None:
    """The command forwards a signal as soon as it knows the flow run's pid; the flow run
    holds it until it is set up, then takes it as a cold engine would."""
    command, marker, _ = _command(tmp_path, starter, "block")
    try:
        deadline = time.monotonic() + 60
        while f"flow run {marker} is pid" not in starter.log:  # closely: its set-up is short
            assert time.monotonic() < deadline, "the starter did not fork the flow run"
            time.sleep(0.002)
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=30) == -signal.SIGTERM
        pid = int(starter.log.split(f"flow run {marker} is pid ")[1].split()[0])
        wait_for(lambda: not psutil.pid_exists(pid), 15, "the flow run to end")
        wait_for(lambda: not _marked(marker), 15, "anything it started to end")
    finally:
        _cleanup(command, marker, None)


def test_a_killed_command_takes_its_flow_run_and_what_it_started(
    tmp_path: Path, starter: Starter
) -> None:
    command, marker, report = _command(tmp_path, starter, "block")
    seen_pid = None
    try:
        seen_pid = _seen(report)["pid"]
        wait_for(lambda: len(_marked(marker)) == 1, 30, "the helper")
        command.send_signal(signal.SIGKILL)  # a cancel's escalation after its grace
        assert command.wait(timeout=10) == -signal.SIGKILL
        wait_for(lambda: not psutil.pid_exists(seen_pid), 15, "the flow run to end")
        wait_for(lambda: not _marked(marker), 15, "the helper to end")
    finally:
        _cleanup(command, marker, seen_pid)


def test_the_socket_is_its_users_alone(starter: Starter) -> None:
    assert stat.S_IMODE(os.stat(starter.socket).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(starter.socket.parent).st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("trying another user needs root")
    child = os.fork()
    if child == 0:  # as another user: refused at the socket's folder
        code = 1
        try:
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as probe:
                probe.connect(str(starter.socket))
        except PermissionError:
            code = 7
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 7


def test_a_starter_refuses_a_folder_others_can_open(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    done = subprocess.run(
        [sys.executable, "-m", "flows.flow_starter", str(shared / "s.sock")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"flow starter: {shared} must be a folder of this user's" in done.stderr
    assert not (shared / "s.sock").exists()


def test_stopping_the_starter_leaves_its_flow_runs_running(tmp_path: Path) -> None:
    """``make down`` stops the starter beside the worker; the flow runs it started live
    on, and their commands still get their exit status."""
    own = _start_starter(tmp_path)
    command, marker, report = _command(tmp_path, own, "block")
    seen_pid = None
    try:
        seen_pid = _seen(report)["pid"]
        _stop_starter(own)
        assert not own.socket.exists()
        time.sleep(1)
        assert command.poll() is None and psutil.pid_exists(seen_pid)
        os.kill(seen_pid, signal.SIGTERM)
        assert command.wait(timeout=30) == -signal.SIGTERM
    finally:
        _stop_starter(own)
        _cleanup(command, marker, seen_pid)


def test_a_changed_file_is_refused_and_the_starter_starts_again_with_it(tmp_path: Path) -> None:
    """Any file the starter imported counts (here a ``sitecustomize`` on its path, as an
    upgraded package's module would): the next flow run starts cold, the one after warm
    again, from the restarted starter."""
    (tmp_path / "sitecustomize.py").write_text("VERSION = 1\n")
    own = _start_starter(tmp_path)
    try:
        (tmp_path / "sitecustomize.py").write_text("VERSION = 2\n")
        command, _, report = _command(tmp_path, own, "exit", stderr=subprocess.PIPE)
        _, err = command.communicate(timeout=60)
        assert command.returncode == 3 and not _seen(report)["warm"]
        assert b"sitecustomize.py changed since this starter imported it" in err
        wait_for(lambda: own.log.count("ready on") == 2, 120, "the starter to start again")
        assert own.process.poll() is None  # the same process, its code imported anew
        command, _, report = _command(tmp_path, own, "exit")
        assert command.wait(timeout=60) == 3 and _seen(report)["warm"]
    finally:
        _stop_starter(own)


def test_without_an_answering_starter_the_command_starts_the_engine_itself(
    tmp_path: Path,
) -> None:
    command, marker, report = _command(
        tmp_path, tmp_path / "no-starter.sock", "exit", stderr=subprocess.PIPE
    )
    _, err = command.communicate(timeout=60)
    seen = _seen(report)
    assert command.returncode == 3
    assert seen["pid"] == command.pid and not seen["warm"]
    assert b"flow starter not used (no answer from" in err
    wait_for(lambda: not _marked(marker), 15, "the guard to end the helper it left")


@pytest.mark.parametrize("difference", ["interpreter", "umask"])
def test_a_command_unlike_the_starter_is_refused_and_starts_the_engine_itself(
    tmp_path: Path, starter: Starter, difference: str
) -> None:
    """Another name for the same interpreter (the starter cannot tell it would import the
    same packages), or a trait a fork cannot take from the command."""
    executable = str(_other_name_of_this_interpreter()) if difference == "interpreter" else None

    def other_umask() -> None:
        os.umask(0o077)

    command, marker, report = _command(
        tmp_path,
        starter,
        "exit",
        executable=executable or sys.executable,
        stderr=subprocess.PIPE,
        preexec_fn=other_umask if difference == "umask" else None,
    )
    _, err = command.communicate(timeout=60)
    seen = _seen(report)
    assert command.returncode == 3 and seen["pid"] == command.pid and not seen["warm"]
    expected = b"another interpreter" if difference == "interpreter" else b"the command's umask:"
    assert b"flow starter not used (" + expected in err
    wait_for(lambda: not _marked(marker), 15, "the guard to end the helper it left")


def _ask(
    starter: Starter, request: dict, tmp_path: Path, gives_up: str = "never"
) -> tuple[list, str]:
    """``request`` sent as the command sends one, from a process whose streams are pipes;
    every reply, and what the forked process wrote to stderr. ``gives_up``: "never" (it
    takes the flow run it is named), "at once" (it closes as soon as its request is out) or
    "at the pid" (named the flow run, it closes instead of taking it): a command whose wait
    for the starter ran out."""
    client = textwrap.dedent(
        f"""
        import json, socket, sys
        from flows.starter_protocol import process_traits, receive, send, send_with_streams
        request = {{"executable": sys.executable, "project": {str(REPO)!r},
                   "module": "engine_standin", "argv": ["x"], "path": sys.path, "env": {{}},
                   "cwd": {str(tmp_path)!r}, "ignored": [], "blocked": [],
                   "traits": process_traits(), **json.loads(sys.argv[1])}}
        gives_up = sys.argv[2]
        replies = []
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect({str(starter.socket)!r})
            send_with_streams(sock, request)
            while gives_up != "at once" and (reply := receive(sock)) is not None:
                replies.append(reply)
                if "pid" in reply and gives_up == "at the pid":
                    break
                if "pid" in reply:
                    send(sock, {{"go": True}})
        print(json.dumps(replies), flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", client, json.dumps(request), gives_up],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": _pythonpath(starter.root)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_another_checkout_or_a_request_without_traits_is_refused(
    tmp_path: Path, starter: Starter
) -> None:
    replies, _ = _ask(starter, {"project": str(tmp_path)}, tmp_path)
    assert replies == [{"refused": f"another checkout ({tmp_path}, this one {REPO})"}]
    replies, _ = _ask(starter, {"traits": None}, tmp_path)
    assert replies == [{"refused": "a request without the command's traits (an older command?)"}]
    assert starter.process.poll() is None  # and it serves on


def test_a_flow_run_that_cannot_be_set_up_exits_1_and_says_why(
    tmp_path: Path, starter: Starter
) -> None:
    """A request the forked process cannot carry out (its working directory is gone) ends
    as a failed cold start would: exit 1, the reason on the command's stderr."""
    gone = tmp_path / "gone"
    replies, err = _ask(starter, {"cwd": str(gone)}, tmp_path)
    assert "pid" in replies[0] and replies[1:] == [{"exit": 1}]
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{gone}'" in err


@pytest.mark.parametrize("gives_up", ["at once", "at the pid"])
def test_a_fork_its_command_gave_up_on_never_runs(
    tmp_path: Path, starter: Starter, gives_up: str
) -> None:
    """A command whose wait for the starter ran out starts the engine itself; the fork the
    starter made for it must not run too, or one flow run would run twice."""
    marker = f"flow-starter-{uuid.uuid4().hex}"
    report = tmp_path / "seen.json"
    argv = ["x", marker, str(report), "exit"]
    replies, _ = _ask(starter, {"argv": argv, "flow_run": marker}, tmp_path, gives_up)
    pid_line = wait_for(
        lambda: re.search(rf"flow run {marker} is pid (\d+)", starter.log), 30, "the fork"
    )
    pid = int(pid_line.group(1))
    assert replies == ([] if gives_up == "at once" else [{"pid": pid}])
    wait_for(lambda: f"pid {pid} ended unstarted" in starter.log, 30, "the fork to be ended")
    wait_for(lambda: not psutil.pid_exists(pid), 30, "the fork to be gone")
    assert not report.exists() and not _marked(marker)


def test_a_changed_source_file_is_noticed(tmp_path: Path) -> None:
    stamp = source_stamp()
    assert str(REPO / "flows" / "flow_starter.py") in stamp
    assert any("site-packages" in path for path in stamp)  # an upgrade counts too
    assert _changed(stamp) is None
    edited = {**stamp, str(REPO / "flows" / "flow_starter.py"): 0}
    assert _changed(edited) == str(REPO / "flows" / "flow_starter.py")
    assert _changed({str(tmp_path / "gone.py"): 0}) == str(tmp_path / "gone.py")


def test_a_deep_stack_folder_gets_a_socket_path_that_fits(tmp_path: Path) -> None:
    short = socket_path(tmp_path)
    assert short == tmp_path / "run" / "flow-starter.sock"
    deep = tmp_path / ("d" * 120)
    path = socket_path(deep)
    assert len(os.fsencode(path)) <= 107 and path != socket_path(tmp_path / ("e" * 120))


def test_a_request_the_starter_answers_and_closes_at_once_is_not_a_broken_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The starter reads the whole request, refuses it and closes before the command's
    send call has returned: the command must still read the refusal, not fail on EPIPE."""
    command, starter_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    real_send_fds = socket.send_fds
    received: list[dict] = []

    def send_then_the_starter_answers(sock, buffers, fds):  # type: ignore[no-untyped-def]
        sent = real_send_fds(sock, buffers, fds)
        request, streams = receive_with_streams(starter_end)
        received.append(request)
        for fd in streams:
            os.close(fd)
        send(starter_end, {"refused": "another checkout"})
        starter_end.close()
        return sent

    monkeypatch.setattr(socket, "send_fds", send_then_the_starter_answers)
    with command:
        send_with_streams(command, {"project": "/elsewhere"})
        assert receive(command) == {"refused": "another checkout"}
    assert received == [{"project": "/elsewhere"}]
