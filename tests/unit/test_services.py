"""infra.services: side-by-side stops that still KILL a service ignoring TERM, a pid file
that outlived its process never gets an unrelated process signalled, and a service does
not inherit the variables it unsets."""

from __future__ import annotations

import os
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
