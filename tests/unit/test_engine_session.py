"""A flow run's process as the stack's pool starts it (``python -m flows.engine_session``):
the engine runs in that very process, in a session of its own, and what it starts ends
with it however it ends. Real processes: a stand-in for Prefect's engine, run as the
session's module, starts a helper that starts a worker, and reports what it sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.integration.helpers import REPO, wait_for

STANDIN = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    marker, report, mode = sys.argv[1:]
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", marker]
    helper = [sys.executable, "-c",
              "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(1000)",
              *sleeper]
    subprocess.Popen(helper)
    seen = {"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgrp(),
            "name": __name__, "spec": __spec__.name,
            "main": sys.modules["__main__"].__spec__.name}
    with open(report + ".tmp", "w") as f:
        json.dump(seen, f)
    os.rename(report + ".tmp", report)
    if mode == "exit":
        while not os.path.exists(report + ".go"):  # the test saw the guard watching
            time.sleep(0.05)
        raise SystemExit(3)
    time.sleep(1000)
    """
)


def _marked(marker: str) -> list[psutil.Process]:
    """The stand-in's helper and its worker (not the session, whose arguments name it too)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if (
            marker in cmdline
            and "flows.engine_session" not in cmdline
            and process.info["status"] != "zombie"
        ):
            found.append(process)
    return found


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    (tmp_path / "engine_standin.py").write_text(STANDIN)
    marker = f"engine-session-{uuid.uuid4().hex}"
    report = tmp_path / "seen.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "PREFECT__FLOW_RUN_ID": marker,
    }
    session = subprocess.Popen(
        [sys.executable, "-m", "flows.engine_session", "engine_standin", marker, str(report), mode],
        env=env,
        cwd=tmp_path,
    )
    return session, marker, report


def _guard(session_pid: int) -> psutil.Process:
    """The session's guard, once it watches the session (its pidfd is open): a process
    killed before its guard could watch it leaves what it started behind."""

    def watching(guard: psutil.Process) -> bool:
        fds = Path(f"/proc/{guard.pid}/fd")
        return any(os.readlink(fd) == "anon_inode:[pidfd]" for fd in fds.iterdir())

    def find():
        with_guard = [
            c
            for c in psutil.Process(session_pid).children()
            if "det_tasks.runner.trial_guard" in c.cmdline()
        ]
        return with_guard[0] if with_guard and watching(with_guard[0]) else None

    return wait_for(find, 60, "the session's guard watching it")


def test_the_engine_runs_as_main_in_a_session_of_its_own_and_a_kill_takes_what_it_started(
    tmp_path: Path,
) -> None:
    session, marker, report = _start(tmp_path, "block")
    try:
        written = wait_for(lambda: report.exists() and report.read_text(), 60, "the report")
        seen = json.loads(written)
        # The worker's pid is the engine's: its signals and exit status reach the engine.
        assert seen["pid"] == session.pid
        assert seen["sid"] == session.pid and seen["pgid"] == session.pid
        assert os.getsid(0) != session.pid
        assert seen["name"] == "__main__"
        assert seen["spec"] == seen["main"] == "engine_standin"
        guard = _guard(session.pid)
        # The flow run's process is the one process that names the flow run.
        assert guard.environ().get("PREFECT__FLOW_RUN_ID") is None
        assert psutil.Process(session.pid).environ()["PREFECT__FLOW_RUN_ID"] == marker
        wait_for(lambda: len(_marked(marker)) == 2, 30, "the helper and its worker")
        session.send_signal(signal.SIGKILL)  # a cancel's escalation, the OOM killer
        assert session.wait(timeout=10) == -signal.SIGKILL
        wait_for(lambda: not _marked(marker), 15, "the helper and its worker to end")
        guard.wait(timeout=15)  # and the guard, after them
    finally:
        for process in _marked(marker):
            process.kill()
        if session.poll() is None:
            session.kill()


def test_an_exit_keeps_its_status_and_ends_what_the_engine_left(tmp_path: Path) -> None:
    session, marker, report = _start(tmp_path, "exit")
    try:
        _guard(session.pid)
        wait_for(lambda: len(_marked(marker)) == 2, 30, "the helper and its worker")
        Path(f"{report}.go").touch()
        assert session.wait(timeout=60) == 3
        wait_for(lambda: not _marked(marker), 15, "the helper and its worker to end")
    finally:
        for process in _marked(marker):
            process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_starters_group_does_not_reach_the_session(
    tmp_path: Path, signum: int
) -> None:
    """Stopping the stack's Prefect worker signals its process group; the flow runs it
    started live on (they wait for the services and train on)."""
    (tmp_path / "engine_standin.py").write_text(STANDIN)
    marker = f"engine-session-{uuid.uuid4().hex}"
    report = tmp_path / "seen.json"
    starter = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        os.setpgid(0, 0)
        # Ended by the group's signal, as the stack's Prefect worker is, even where it was
        # started in the background of a shell (which starts it ignoring SIGINT).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        session = subprocess.Popen([sys.executable, "-m", "flows.engine_session",
                                    "engine_standin", {marker!r}, {str(report)!r}, "block"])
        print(session.pid, flush=True)
        time.sleep(1000)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    worker = subprocess.Popen(
        [sys.executable, "-c", starter], env=env, cwd=tmp_path, stdout=subprocess.PIPE
    )
    session_pid = 0
    try:
        assert worker.stdout is not None
        session_pid = int(worker.stdout.readline())
        wait_for(report.exists, 60, "the report")
        os.killpg(worker.pid, signum)
        worker.wait(timeout=10)
        time.sleep(1)
        assert psutil.Process(session_pid).status() != psutil.STATUS_ZOMBIE
        assert len(_marked(marker)) == 2
    finally:
        if session_pid:
            os.kill(session_pid, signal.SIGKILL)
        wait_for(lambda: not _marked(marker), 15, "the helper and its worker to end")
        if worker.poll() is None:
            worker.kill()
