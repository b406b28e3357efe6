"""``det-tasks run``'s signals, in one process: the resume command keeps the user's
arguments and replaces an earlier ``--resume``; a SIGHUP or SIGTERM ignored at start stays
ignored; the first signal asks the trial to stop at its next batch boundary, the second
stops at once; a worker group's launcher stops its ranks on a closed terminal's SIGHUP
(they run in a session of their own) but not under ``nohup``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from det_tasks.runner import worker_group
from det_tasks.runner.stop_signals import SignalStop, StoppedAtOnce, StopSignals, resume_command


def test_the_resume_command_keeps_the_arguments_and_replaces_an_earlier_resume() -> None:
    argv = ["run", "c.yaml", "--resume", "old", "-p", "a=b c", "--resume=older", "--no-progress"]
    assert resume_command(argv, "/ck/new uuid") == (
        "det-tasks run c.yaml -p 'a=b c' --no-progress --resume '/ck/new uuid'"
    )


class _Context:
    def __init__(self) -> None:
        self.stop = False

    def set_stop_requested(self, value: bool) -> None:
        self.stop = value


@pytest.fixture
def hangup_default() -> Iterator[None]:
    """SIGHUP at its default, as in a terminal, whatever this test run inherited (started
    under ``nohup``, every process ignores it), and put back afterwards."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_first_signal_stops_at_the_boundary_second_at_once(hangup_default: None) -> None:
    stop = StopSignals()
    context = _Context()
    stop.watch(context)
    before = signal.getsignal(signal.SIGTERM)  # pytest's own (tests/conftest.py)
    with stop.handled():
        os.kill(os.getpid(), signal.SIGTERM)
        assert context.stop and stop.signum == signal.SIGTERM
        with pytest.raises(StoppedAtOnce) as at_once:
            os.kill(os.getpid(), signal.SIGHUP)
    assert at_once.value.signum == signal.SIGHUP
    assert signal.getsignal(signal.SIGTERM) is before  # put back
    with pytest.raises(SignalStop) as stopped:
        stop.raise_if_stopped(57, "/ck/abc")
    assert (stopped.value.exit_code, stopped.value.state) == (143, "PAUSED")


def test_a_signal_ignored_at_start_stays_ignored() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop = StopSignals()
        stop.watch(_Context())
        with stop.handled():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
        assert stop.signum is None
    finally:
        signal.signal(signal.SIGHUP, previous)


_LAUNCHER = """
import os, signal, sys, threading
from det_tasks.runner import worker_group
# nohup ignores SIGHUP; a terminal's job has it at its default, whatever this run inherited.
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == "nohup" else signal.SIG_DFL)
worker_group.launch_command = lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(4)"]
worker_group.worker_env = lambda *a: dict(os.environ)
threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGHUP)).start()
print(worker_group.run_workers(2, "torch", []), flush=True)
"""


@pytest.mark.parametrize(("how", "code"), [("tty", 128 + signal.SIGHUP), ("nohup", 0)])
def test_a_worker_groups_launcher_stops_its_ranks_on_sighup_unless_ignored(
    tmp_path: Path, how: str, code: int
) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(_LAUNCHER))
    repo = Path(worker_group.__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script), how],
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(code)]
    sleeping = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "time.sleep(4)" in " ".join(p.info["cmdline"] or [])
    ]
    assert sleeping == []  # the ranks' tree ended with the launcher, or finished


def test_the_handlers_are_installed_only_in_the_main_thread() -> None:
    stop = StopSignals()
    seen: list[object] = []
    before = signal.getsignal(signal.SIGTERM)

    def other() -> None:
        with stop.handled():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [before]
