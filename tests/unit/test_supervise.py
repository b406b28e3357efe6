"""infra.supervise keeps a command running (a Dask worker closes for good when its scheduler
goes away) and stops with it, however it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.supervise import FIRST_DELAY_S, PASS_ON_AFTER_S

# Appends one line per start to a file, then exits (code 0 or 1: either is restarted).
STARTS = "import sys; open(sys.argv[1], 'a').write('start\\n'); sys.exit(int(sys.argv[2]))"
# Writes its pid, then sleeps until signalled.
SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(1000)"


def _supervised(*command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "infra.supervise", "test", "--", *command],
        start_new_session=True,  # as infra.services starts every service
        stderr=subprocess.PIPE,
    )


def _starts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_command_that_exits_is_started_again_until_the_group_is_stopped(
    tmp_path: Path,
) -> None:
    log = tmp_path / "starts"
    supervisor = _supervised(sys.executable, "-c", STARTS, str(log), "1")
    # First start at once, the next after FIRST_DELAY_S, the one after 2 * FIRST_DELAY_S.
    _wait_for(lambda: _starts(log) >= 3, 30)
    os.killpg(supervisor.pid, signal.SIGTERM)
    supervisor.wait(timeout=5)
    count = _starts(log)
    time.sleep(FIRST_DELAY_S * 4 + 1)  # nothing starts it again
    assert _starts(log) == count
    _, err = supervisor.communicate()
    assert b"exited with code 1" in err and b"starting it again" in err


def test_a_clean_exit_is_restarted_too(tmp_path: Path) -> None:
    """A Dask worker whose scheduler went away closes and exits 0: it must come back."""
    log = tmp_path / "starts"
    supervisor = _supervised(sys.executable, "-c", STARTS, str(log), "0")
    try:
        _wait_for(lambda: _starts(log) >= 2, 30)
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait()


def test_a_stop_sent_to_the_group_ends_both_at_once(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    supervisor = _supervised(sys.executable, "-c", SLEEPER, str(pid_file))
    _wait_for(pid_file.exists, 30)
    child = int(pid_file.read_text())
    started = time.monotonic()
    os.killpg(supervisor.pid, signal.SIGTERM)
    supervisor.wait(timeout=5)  # not restarted, not waiting to pass the stop on
    assert time.monotonic() - started < PASS_ON_AFTER_S
    _wait_for(lambda: not _alive(child), 5)


def test_a_stop_sent_to_the_supervisor_alone_reaches_the_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    supervisor = _supervised(sys.executable, "-c", SLEEPER, str(pid_file))
    _wait_for(pid_file.exists, 30)
    child = int(pid_file.read_text())
    supervisor.send_signal(signal.SIGTERM)
    supervisor.wait(timeout=PASS_ON_AFTER_S + 10)
    _wait_for(lambda: not _alive(child), 5)
    assert pid_file.read_text() == str(child), "the command was started again"


def test_nohup_keeps_sighup_ignored(tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored at start) a SIGHUP stops nothing."""
    pid_file = tmp_path / "pid"
    supervisor = subprocess.Popen(
        ["nohup", sys.executable, "-m", "infra.supervise", "test", "--", sys.executable,
         "-c", SLEEPER, str(pid_file)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_for(pid_file.exists, 30)
        os.killpg(supervisor.pid, signal.SIGHUP)
        time.sleep(1)
        assert supervisor.poll() is None and _alive(int(pid_file.read_text()))
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is not alive
        return stat.read().split(") ", 1)[1][0] != "Z"
