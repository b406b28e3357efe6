"""How a ``python -m flows.experiment`` run ends: without the interpreter's last garbage
collections (1.6-1.8 s with torch, Prefect and MLflow loaded), and without waiting on a
flow-run heartbeat thread when the Prefect server is the run's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_keeps_the_code_and_the_atexit_handlers_and_skips_the_collection() -> None:
    done = _python(
        "import atexit, gc, sys\n"
        "from flows.console import exit_without_final_collection\n"
        "junk = [[i] for i in range(1000)]\n"
        "state = lambda: print('atexit ran', gc.isenabled(), gc.get_freeze_count() > 999)\n"
        "atexit.register(state)\n"
        "print('work done', end='')\n"
        "exit_without_final_collection(3)\n"
    )
    assert done.returncode == 3, done.stderr
    # Buffered output is flushed and the handler ran with the collector off, the heap frozen.
    assert done.stdout == "work doneatexit ran False True\n"


_HEARTBEAT = (
    "from flows.experiment import run_settings\n"
    "from prefect.settings import get_current_settings as current\n"
    "with run_settings(own_server=True):\n"
    "    own = current().flows.heartbeat_frequency\n"
    "with run_settings(own_server=False):\n"
    "    lasting = current().flows.heartbeat_frequency\n"
    "print(own, lasting, current().server.ephemeral.startup_timeout_seconds)\n"
)


def test_heartbeats_are_off_on_the_runs_own_server_only() -> None:
    done = _python(_HEARTBEAT)
    assert done.returncode == 0, done.stderr
    # Prefect's default 180 s stays for a lasting server; the settings end with the block.
    own, lasting, after = done.stdout.split()
    assert (own, lasting) == ("None", "180")
    assert after == "20"


def test_a_heartbeat_frequency_the_user_set_is_kept() -> None:
    done = _python(_HEARTBEAT, PREFECT_FLOWS_HEARTBEAT_FREQUENCY="60")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["60", "60"]


def test_the_det_executable_exits_with_mains_code() -> None:
    done = _python(
        "import atexit, gc, sys\n"
        "from flows.det_cli import command\n"
        "atexit.register(lambda: print('collector on:', gc.isenabled()))\n"
        "sys.argv = ['det', 'experiment', 'list']\n"
        "command()\n",
        PREFECT_API_URL="http://127.0.0.1:9/api",
    )
    # main's code for an unreachable platform, its message, and the collector off at exit.
    assert done.returncode == 1, done.stderr
    assert "no platform at http://127.0.0.1:9/api" in done.stderr
    assert done.stdout == "collector on: False\n"
