"""The stack's warm flow-run starter (``flows.flow_starter``) and the pool's command that
uses it (``python -m flows.engine_session`` with ``DET_TASKS_FLOW_STARTER``): real
processes, a real starter that has imported Prefect, and a stand-in for Prefect's engine
that starts a helper and reports what it sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flows.flow_starter import _changed, source_stamp
from flows.starter_protocol import STARTER_ENV, socket_path
from tests.integration.helpers import REPO, wait_for

STANDIN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    marker, report, mode = sys.argv[1:]
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", marker]
    subprocess.Popen(sleeper)
    print("standin says hello", flush=True)
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
            "pgid": os.getpgrp(), "name": __name__, "spec": __spec__.name,
            "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path,
            "value": os.environ.get("STANDIN_VALUE"),
            "hup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
            "int_handler": signal.getsignal(signal.SIGINT) == signal.default_int_handler,
            "warm": "prefect.engine" in sys.modules and "mlflow" in sys.modules}
    with open(report + ".tmp", "w") as f:
        json.dump(seen, f)
    os.rename(report + ".tmp", report)
    if mode == "exit":
        raise SystemExit(3)
    time.sleep(1000)
    """
)


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


def _start_starter(root: Path) -> tuple[subprocess.Popen[bytes], Path]:
    path = socket_path(root)
    starter = subprocess.Popen(
        [sys.executable, "-u", "-m", "flows.flow_starter", str(path)],
        cwd=REPO,
        stdout=open(root / "starter.log", "ab"),  # noqa: SIM115 -- the child keeps it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for(path.exists, 120, "the starter's socket")
    return starter, path


def _stop_starter(starter: subprocess.Popen[bytes]) -> None:
    if starter.poll() is None:
        os.killpg(starter.pid, signal.SIGTERM)
        starter.wait(timeout=30)


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("starter")
    process, path = _start_starter(root)
    try:
        yield path
    finally:
        _stop_starter(process)


def _command(
    tmp_path: Path,
    starter: Path | None,
    mode: str,
    executable: str = sys.executable,
    **popen: object,
) -> tuple[subprocess.Popen[bytes], str, Path]:
    (tmp_path / "engine_standin.py").write_text(STANDIN)
    marker = f"flow-starter-{uuid.uuid4().hex}"
    report = tmp_path / "seen.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "PREFECT__FLOW_RUN_ID": marker,
        "STANDIN_VALUE": "from the command",
    }
    if starter is not None:
        env[STARTER_ENV] = str(starter)
    argv = [executable, "-m", "flows.engine_session", "engine_standin", marker, str(report), mode]
    command = subprocess.Popen(argv, env=env, cwd=tmp_path, **popen)  # type: ignore[call-overload]
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


def test_the_starter_forks_the_flow_run_warm_with_the_commands_streams_and_settings(
    tmp_path: Path, starter: Path
) -> None:
    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup

    command, marker, report = _command(
        tmp_path, starter, "exit", stdout=subprocess.PIPE, preexec_fn=ignore_hangup
    )
    out, _ = command.communicate(timeout=60)
    seen = _seen(report)
    assert command.returncode == 3  # the engine's exit status is the command's
    assert b"standin says hello" in out  # written to the command's own stdout
    assert seen["warm"]  # Prefect's engine and MLflow were imported before it started
    assert seen["pid"] != command.pid
    assert seen["sid"] == seen["pid"] == seen["pgid"]  # a session of its own
    assert seen["name"] == "__main__" and seen["spec"] == "engine_standin"
    assert seen["argv"] == [str(tmp_path / "engine_standin.py"), marker, str(report), "exit"]
    assert seen["cwd"] == str(tmp_path) and str(tmp_path) in seen["path"]
    assert seen["value"] == "from the command"
    assert seen["hup_ignored"] and seen["int_handler"]
    wait_for(lambda: not _marked(marker), 15, "the guard to end the helper it left")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_command_reaches_the_flow_run(
    tmp_path: Path, starter: Path, signum: int
) -> None:
    command, marker, report = _command(tmp_path, starter, "block")
    seen_pid = None
    try:
        seen_pid = _seen(report)["pid"]
        wait_for(lambda: len(_marked(marker)) == 1, 30, "the helper")
        command.send_signal(signum)
        # The flow run ended by it (SIGINT: Python's KeyboardInterrupt, which ends the
        # interpreter by SIGINT), and the command with the same status, as a cold engine.
        assert command.wait(timeout=30) == -signum
        assert not psutil.pid_exists(seen_pid)
        wait_for(lambda: not _marked(marker), 15, "the helper to end")
    finally:
        _cleanup(command, marker, seen_pid)


def test_a_killed_command_takes_its_flow_run_and_what_it_started(
    tmp_path: Path, starter: Path
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


def test_stopping_the_starter_leaves_its_flow_runs_running(tmp_path: Path) -> None:
    """``make down`` stops the starter beside the worker; the flow runs it started live
    on, and their commands still get their exit status."""
    process, path = _start_starter(tmp_path)
    command, marker, report = _command(tmp_path, path, "block")
    seen_pid = None
    try:
        seen_pid = _seen(report)["pid"]
        _stop_starter(process)
        assert not path.exists()
        time.sleep(1)
        assert command.poll() is None and psutil.pid_exists(seen_pid)
        os.kill(seen_pid, signal.SIGTERM)
        assert command.wait(timeout=30) == -signal.SIGTERM
    finally:
        _stop_starter(process)
        _cleanup(command, marker, seen_pid)


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


def test_another_interpreter_is_refused_and_starts_the_engine_itself(
    tmp_path: Path, starter: Path
) -> None:
    # The same environment's interpreter under another name: the starter cannot tell it
    # would import the same packages, so it refuses.
    names = ("python3", "python", f"python3.{sys.version_info.minor}")
    here = Path(sys.executable)
    other = next(here.with_name(n) for n in names if n != here.name and here.with_name(n).exists())
    command, marker, report = _command(
        tmp_path, starter, "exit", executable=str(other), stderr=subprocess.PIPE
    )
    _, err = command.communicate(timeout=60)
    seen = _seen(report)
    assert command.returncode == 3 and seen["pid"] == command.pid and not seen["warm"]
    assert b"flow starter not used (another interpreter" in err
    wait_for(lambda: not _marked(marker), 15, "the guard to end the helper it left")


def test_a_changed_source_file_is_noticed(tmp_path: Path) -> None:
    """The starter refuses (and starts again) once a file it imported has changed."""
    stamp = source_stamp()
    assert str(REPO / "flows" / "flow_starter.py") in stamp
    assert not any("site-packages" in path for path in stamp)
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


def test_a_flow_run_that_cannot_be_set_up_exits_1_and_says_why(
    tmp_path: Path, starter: Path
) -> None:
    """A request the forked process cannot carry out (its working directory is gone) ends
    as a failed cold start would: exit 1, the reason on the command's stderr."""
    gone = tmp_path / "gone"
    client = textwrap.dedent(
        f"""
        import json, socket, sys
        from flows.starter_protocol import receive, send_with_streams
        request = {{"executable": sys.executable, "project": {str(REPO)!r},
                   "module": "engine_standin", "argv": ["x"], "path": sys.path,
                   "env": {{}}, "cwd": {str(gone)!r}, "ignored": []}}
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect({str(starter)!r})
            send_with_streams(sock, request)
            print(json.dumps([receive(sock), receive(sock)]), flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", client], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    first, last = json.loads(done.stdout)
    assert "pid" in first and last == {"exit": 1}
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{gone}'" in done.stderr
