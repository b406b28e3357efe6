"""A trial's processes end with the trial (``det_tasks.runner.trial_processes``): at its end
(SIGTERM, then SIGKILL for one that ignores it), and, through the guard, when the process
that ran it dies at once. Real processes, counted by a marker on their command lines; each
case runs in a process of its own, as a trial's runner does (a Dask worker,
``det-tasks run``), so the test process never becomes a subreaper."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# Run as `MARKER=... python -c RUNNER MODE`: a runner whose "trial" starts a helper that starts
# a worker, a daemon in a session of its own, and an orphan (its parent exits at once).
RUNNER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from det_tasks.runner.trial_processes import TrialProcesses, own_trial_processes

    marker, mode = os.environ["MARKER"], sys.argv[1]  # not on this one's command line
    print(os.getpid(), flush=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", marker]
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(1000)", marker]
    ORPHANS_PARENT = "import subprocess, sys; subprocess.Popen(sys.argv[1:])"  # exits at once
    helper = (
        "import subprocess, sys, time; s = sys.argv[1:]; "
        "subprocess.Popen(s); subprocess.Popen(s, start_new_session=True); "
        f"subprocess.Popen([sys.executable, '-c', {ORPHANS_PARENT!r}, *s]); time.sleep(1000)"
    )

    def marked():
        return [p for p in __import__("psutil").process_iter(["cmdline", "status"])
                if marker in (p.info["cmdline"] or []) and p.info["status"] != "zombie"]

    def count():
        return len(marked())

    def started(expected):
        # Settled once the orphan's parent is gone: until then it is counted and the orphan
        # may not exist yet, so the count can pass through ``expected`` on its way.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = marked()
            parents = [p for p in alive if p.info["cmdline"][2:3] == [ORPHANS_PARENT]]
            if len(alive) == expected and not parents:
                return len(alive)
            time.sleep(0.05)
        return count()

    if mode == "atexit":
        own_trial_processes()
        subprocess.Popen([sys.executable, "-c", helper, *sleeper])
        print(started(4), flush=True)
        raise SystemExit(3)  # an error ends the run: its processes end all the same
    processes = TrialProcesses.start()
    platform = subprocess.Popen(sleeper)  # before the trial: the runner's own, kept
    processes.begin()
    subprocess.Popen([sys.executable, "-c", helper, *sleeper])
    if mode == "stubborn":
        subprocess.Popen(stubborn)
    print(started(6 if mode == "stubborn" else 5), flush=True)
    if mode == "kill":
        time.sleep(1)  # the guard's look (every 0.5 s) has seen them
        os.kill(os.getpid(), signal.SIGKILL)
    began = time.monotonic()
    processes.end()
    print(round(time.monotonic() - began, 1), count(), platform.poll(), flush=True)
    platform.kill()
    processes.close()
    """
)


def _run(mode: str) -> tuple[str, int, list[str], str]:
    """The runner's marker, pid, printed words and stderr."""
    marker = f"trial-processes-{uuid.uuid4().hex}"
    # Output to files: a process left running would hold a pipe open.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        subprocess.run(
            [sys.executable, "-c", RUNNER, mode],
            env={**os.environ, "MARKER": marker},
            stdout=out,
            stderr=err,
            timeout=120,
            cwd=REPO,
        )
        out.seek(0)
        err.seek(0)
        words, errors = out.read().split(), err.read()
    pid, *printed = words
    return marker, int(pid), printed, errors[-3000:]


def _left(marker: str) -> list[psutil.Process]:
    """Processes still running (zombies are not) whose command line carries ``marker``."""
    return [
        process
        for process in psutil.process_iter(["cmdline", "status"])
        if marker in (process.info["cmdline"] or []) and process.info["status"] != "zombie"
    ]


def _settled(marker: str, runner: int, within_s: float = 10.0) -> list[psutil.Process]:
    """The marked processes left once the runner's guard is gone (it ends them first)."""
    deadline = time.monotonic() + within_s
    while _guards_of(runner) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _guards_of(runner) == [], "the guard outlived its runner"
    return _left(marker)


def _guards_of(runner: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if (p.info["cmdline"] or [])[-2:-1] == [str(runner)]
        and "det_tasks.runner.trial_guard" in (p.info["cmdline"] or [])
        and p.info["status"] != "zombie"
    ]


def test_the_trials_processes_end_and_the_runners_own_stay() -> None:
    marker, runner, out, err = _run("end")
    # The runner's own + the helper, its worker, its daemon (setsid) and its orphan
    # (reparented to the runner, a subreaper): 5; then only the runner's own, still running.
    assert out[0] == "5" and out[2:] == ["1", "None"], err
    assert float(out[1]) < 2.0  # they end on SIGTERM: no grace spent
    assert _settled(marker, runner) == []


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    marker, runner, out, err = _run("stubborn")
    assert out[0] == "6" and out[2:] == ["1", "None"], err
    assert 2.5 <= float(out[1]) < 9  # GRACE_S (3 s), then SIGKILL (slower on a loaded host)
    assert _settled(marker, runner) == []


def test_the_guard_ends_them_when_the_runner_is_killed() -> None:
    marker, runner, out, err = _run("kill")
    assert out == ["5"], err  # SIGKILLed before it could end anything itself
    left = _settled(marker, runner)
    try:
        # Everything the trial started went; the runner's own (started before the trial,
        # now an orphan) is not the trial's and stays.
        assert len(left) == 1, [p.info["cmdline"] for p in left]
        assert left[0].ppid() != runner
    finally:
        for process in left:
            process.kill()


def test_det_tasks_runs_processes_end_when_it_exits_with_an_error() -> None:
    marker, runner, out, err = _run("atexit")
    assert out == ["4"], err
    assert _left(marker) == []  # ended before the process exited: nothing to wait for
    assert _settled(marker, runner) == []


MARKS_AND_EXITS = textwrap.dedent(
    """
    import os, subprocess, sys
    from det_tasks.runner.trial_processes import mark_what_this_process_starts
    mark = mark_what_this_process_starts()
    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", sys.argv[1]]
    child = subprocess.Popen(sleeper, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(os.getpid(), mark, child.pid, flush=True)
    """
)


def test_a_guard_that_starts_after_its_runner_is_gone_still_ends_what_it_started() -> None:
    """A flow run forked warm can start a process, and be killed, before its guard's
    interpreter has started: the guard finds the pid gone, or another process's (the
    create time in the mark differs), and ends what carries the mark."""
    for reused in (False, True):
        marker = f"guard-late-{uuid.uuid4().hex}"
        done = subprocess.run(
            [sys.executable, "-c", MARKS_AND_EXITS, marker],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        pid, mark, child = done.stdout.split()
        assert psutil.pid_exists(int(child))
        watched = str(os.getpid()) if reused else pid  # a live process that is not the runner
        try:
            guard = subprocess.run(
                [sys.executable, "-m", "det_tasks.runner.trial_guard", watched, mark],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                timeout=60,
            )
            assert guard.returncode == 0
            with_marker = [
                p
                for p in psutil.process_iter(["cmdline", "status"])
                if marker in (p.info["cmdline"] or []) and p.info["status"] != "zombie"
            ]
            assert with_marker == []
        finally:
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(child)).kill()
