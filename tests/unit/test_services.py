"""infra.services: side-by-side stops that still KILL a service ignoring TERM, a pid file
that outlived its process never gets an unrelated process signalled, and a service does
not inherit the variables it unsets."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.services import Service, is_running, start_all, stop, stop_all


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our exited child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _service(root: Path, name: str, script: str, stop_timeout_s: float = 20.0) -> Service:
    return Service(name, ["bash", "-c", script], lambda: True, root, stop_timeout_s=stop_timeout_s)


def test_stop_all_terms_each_and_kills_the_one_that_ignores_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    polite = _service(
        tmp_path,
        "polite",
        f"trap 'echo stopped > {tmp_path}/polite.out; exit 0' TERM; while :; do sleep 0.1; done",
    )
    stubborn = _service(
        tmp_path, "stubborn", "trap '' TERM; while :; do sleep 0.1; done", stop_timeout_s=1
    )
    assert start_all([polite, stubborn]) == [True, True]
    time.sleep(0.5)  # both traps are set
    pids = [int(s.pidfile.read_text()) for s in (polite, stubborn)]
    assert stop_all([polite, stubborn]) == [True, True]
    assert not any(_alive(pid) for pid in pids)
    assert (tmp_path / "polite.out").read_text().strip() == "stopped"  # TERM, not KILL
    killed = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
    assert killed == [
        f"stubborn did not stop within 1 s of SIGTERM; killing it (log: {stubborn.logfile})"
    ]
    assert not polite.pidfile.exists() and not stubborn.pidfile.exists()
    assert stop_all([polite, stubborn]) == [False, False]  # nothing left to stop


def test_a_pid_file_naming_an_unrelated_process_is_not_signalled(tmp_path: Path) -> None:
    """After a reboot or a crash the recorded pid may belong to anything; every service
    started here leads its own process group, and a pid that does not is left alone."""
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        service = _service(tmp_path, "gone", "sleep 60")
        service.pidfile.parent.mkdir(parents=True)
        service.pidfile.write_text(str(unrelated.pid))
        assert not is_running(service)
        assert stop(service) is False
        assert unrelated.poll() is None
        assert not service.pidfile.exists()
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_service_does_not_inherit_what_it_unsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefect's server started from a shell that points at a server (`source .stack/env`)
    must not take that server for its own API."""
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    out = tmp_path / "seen.out"
    service = Service(
        "env-check",
        ["bash", "-c", f"echo ${{PREFECT_API_URL-unset}} > {out}; sleep 30"],
        lambda: out.exists() and out.read_text() != "",
        tmp_path,
        unset=("PREFECT_API_URL",),
    )
    try:
        start_all([service])
        assert out.read_text().strip() == "unset"
    finally:
        stop(service)


def test_a_stop_kills_at_once_when_the_service_says_its_graceful_part_is_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SeaweedFS lingers 15 s on TERM waiting for streams that never end, after it stopped
    serving: its ``stop_done`` ends that wait, and no warning says it was forced."""
    marker = tmp_path / "closed"
    lingering = Service(
        "lingering",
        ["bash", "-c", f"trap 'touch {marker}' TERM; while :; do sleep 0.1; done"],
        lambda: True,
        tmp_path,
        stop_timeout_s=30,
        stop_done=marker.exists,
    )
    start_all([lingering])
    time.sleep(0.5)  # the trap is set
    pid = int(lingering.pidfile.read_text())
    started = time.monotonic()
    assert stop(lingering) is True
    assert time.monotonic() - started < 5  # not the 30 s grace
    assert marker.exists() and not _alive(pid)
    assert not [r for r in caplog.records if "did not stop" in r.getMessage()]


def test_a_service_is_asked_to_stop_with_its_own_signal(tmp_path: Path) -> None:
    """PostgreSQL's clean stop that does not wait on its clients is SIGINT, not SIGTERM."""
    out = tmp_path / "signal.out"
    # Python's handlers, not bash traps: a shell cannot trap a signal ignored when it
    # started, and a CI script run in the background starts its jobs with SIGINT ignored.
    records = (
        "import signal, sys, time\n"
        "def note(signum, _):\n"
        f"    open({str(out)!r}, 'w').write(signal.Signals(signum).name); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, note); signal.signal(signal.SIGTERM, note)\n"
        "while True: time.sleep(0.1)\n"
    )
    service = Service(
        "int-stop",
        [sys.executable, "-c", records],
        lambda: True,
        tmp_path,
        stop_signal=signal.SIGINT,
    )  # fmt: skip
    start_all([service])
    time.sleep(0.5)
    assert stop(service) is True
    assert out.read_text() == "SIGINT"


def test_a_stop_does_not_wait_for_an_exited_process_to_be_reaped(tmp_path: Path) -> None:
    """A zombie has exited: it waits only for its parent to reap it (init, for an orphan,
    took up to 1.3 s here). The group is stopped once no member has yet to exit."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    os._exit(0)\n"
         "print(pid, flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        zombie = int(parent.stdout.readline())
        service = _service(tmp_path, "exited", "sleep 60", stop_timeout_s=30)
        service.pidfile.parent.mkdir(parents=True)
        service.pidfile.write_text(str(zombie))
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        assert stop(service) is True  # its own group's leader, unreaped: "running"
        assert time.monotonic() - started < 5  # not the 30 s grace
        assert _alive(zombie)  # still unreaped: its parent has not waited for it
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_service_runs_as_its_user_without_a_wrapper(tmp_path: Path) -> None:
    """The process itself runs as ``user`` with that user's group only (PostgreSQL under
    root): no `runuser` in between to delay its stop and KILL it 2 s into its checkpoint."""
    nobody = pwd.getpwnam("nobody")
    service = Service(
        "as-nobody",
        ["bash", "-c", "echo ids $(id -u) $(id -G); exec sleep 30"],
        lambda: "ids" in service.logfile.read_text(),
        tmp_path,
        user="nobody",
    )
    try:
        start_all([service])
        pid = int(service.pidfile.read_text())
        assert service.logfile.read_text().split() == [
            "ids",
            str(nobody.pw_uid),
            str(nobody.pw_gid),
        ]
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"  # no wrapper
    finally:
        stop(service)


def test_a_service_healthy_long_before_its_turn_is_not_stopped_as_late(tmp_path: Path) -> None:
    """start_all awaits services in turn: one whose start deadline passed while an earlier
    one was awaited (a loaded host) is still looked at, not stopped unseen."""
    ready_at = time.monotonic() + 1.5
    slow = Service("slow", ["sleep", "30"], lambda: time.monotonic() >= ready_at, tmp_path)
    quick = Service("quick", ["sleep", "30"], lambda: True, tmp_path, start_timeout_s=0.5)
    try:
        assert start_all([slow, quick]) == [True, True]
        assert is_running(quick)
    finally:
        stop_all([slow, quick])


def test_a_group_whose_leader_died_is_still_stopped(tmp_path: Path) -> None:
    """A wrapper shell killed alone (SeaweedFS runs its four parts under one) leaves its
    servers running in the service's group: a stop must still end them, or their ports
    stay taken and the next start fails."""
    service = _service(tmp_path, "wrapper", f"sleep 1000 & echo $! > {tmp_path}/child; wait")
    assert start_all([service]) == [True]
    pid_file = tmp_path / "child"
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    leader = int(service.pidfile.read_text())
    os.kill(leader, signal.SIGKILL)
    os.waitpid(leader, 0)  # the leader is gone, reaped; its child lives on in its group
    assert _alive(child)
    assert is_running(service)
    assert stop(service) is True
    deadline = time.monotonic() + 5
    while _alive(child):  # an orphan: init reaps it
        assert time.monotonic() < deadline, "the leaderless group's member was not stopped"
        time.sleep(0.05)


# A server whose main thread has exited ("Z" in /proc) while another thread still runs and
# holds its listening socket: what a multi-threaded server SIGKILLed on a loaded host looks
# like for a moment. Its helper thread lets go of the port after HOLD_S.
_THREAD_HOLDS_THE_PORT = """
import ctypes, signal, socket, sys, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
open(sys.argv[1], "w").write(str(server.getsockname()[1]))
threading.Thread(target=time.sleep, args=(float(sys.argv[2]),)).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_stop_returns_only_once_the_last_thread_let_go_of_its_port(tmp_path: Path) -> None:
    """CI of stop 55: ``make down`` returned while SeaweedFS still held a port (its main
    thread a zombie, its other threads exiting), and the ``make up`` right after it was
    refused. A group is stopped once no thread of it runs, not once main threads are
    zombies."""
    from infra.services import port_holder, port_open

    script = tmp_path / "server.py"
    script.write_text(_THREAD_HOLDS_THE_PORT)
    port_file = tmp_path / "port"
    service = Service(
        "threads",
        [sys.executable, str(script), str(port_file), "3"],
        lambda: True,
        tmp_path,
        stop_timeout_s=20,
    )
    assert start_all([service]) == [True]
    deadline = time.monotonic() + 10
    while not port_file.exists() or not port_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    port = int(port_file.read_text())
    time.sleep(0.3)  # the main thread has exited: a zombie leader, the port still held
    assert port_open(port)
    started = time.monotonic()
    assert stop(service) is True
    assert not port_open(port), f"stop returned with port {port} still taken{port_holder(port)}"
    assert time.monotonic() - started < 15  # the thread's own end, not the KILL deadline


def test_a_refused_start_names_what_holds_the_port(tmp_path: Path) -> None:
    import socket

    from infra.services import port_holder

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert (
            port_holder(port)
            == f" (held by pid {os.getpid()}: "
            + " ".join(" ".join(__import__("psutil").Process().cmdline()).split())[:200]
            + ")"
        )
