"""How a ``python -m flows.experiment`` run ends: without the interpreter's last garbage
collections (1.6-1.8 s with torch, Prefect and MLflow loaded), and without waiting on a
flow-run heartbeat thread when the Prefect server is the run's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with no Prefect settings of this machine's (no
    PREFECT_* variables, an empty profiles file) and no DET_MASTER."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DET_MASTER"
    }
    isolated = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_PROFILES_PATH": str(home / "profiles.toml"),
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=home,
        env={**clean, **isolated, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_keeps_the_code_and_the_atexit_handlers_and_skips_the_collection(
    tmp_path: Path,
) -> None:
    done = _python(
        "import atexit, gc, sys\n"
        "from flows.quiet_shutdown import exit_without_final_collection\n"
        "junk = [[i] for i in range(1000)]\n"
        "state = lambda: print('atexit ran', gc.isenabled(), gc.get_freeze_count() > 999)\n"
        "atexit.register(state)\n"
        "print('work done', end='')\n"
        "exit_without_final_collection(3)\n",
        tmp_path,
    )
    assert done.returncode == 3, done.stderr
    # Buffered output is flushed and the handler ran with the collector off, the heap frozen.
    assert done.stdout == "work doneatexit ran False True\n"


_HEARTBEAT = (
    "from flows.experiment import run_settings\n"
    "from prefect.settings import get_current_settings as current\n"
    "with run_settings('http://127.0.0.1:4311/api'):\n"
    "    prestarted = current().flows.heartbeat_frequency\n"
    "    api = current().api.url\n"
    "with run_settings(None):\n"
    "    otherwise = current().flows.heartbeat_frequency\n"
    "print(prestarted, otherwise, current().server.ephemeral.startup_timeout_seconds, api)\n"
)


def test_heartbeats_are_off_on_a_server_the_run_starts(tmp_path: Path) -> None:
    # No API URL anywhere: Prefect starts its ephemeral server, which ends with the run.
    done = _python(_HEARTBEAT, tmp_path)
    assert done.returncode == 0, done.stderr
    # The settings end with the block.
    assert done.stdout.split() == ["None", "None", "20", "http://127.0.0.1:4311/api"]


def test_heartbeats_stay_on_a_lasting_server(tmp_path: Path) -> None:
    # The stack's or the warm services' server, named by the environment or by a profile:
    # Prefect's default 180 s, unless the run started the server itself.
    by_env = _python(_HEARTBEAT, tmp_path, PREFECT_API_URL="http://127.0.0.1:4200/api")
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout.split()[:2] == ["None", "180"]
    # A prestarted server's final port wins over the URL Prefect read at import.
    assert by_env.stdout.split()[3] == "http://127.0.0.1:4311/api"
    (tmp_path / "profiles.toml").write_text(
        'active = "stack"\n[profiles.stack]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n'
    )
    by_profile = _python(_HEARTBEAT, tmp_path)
    assert by_profile.returncode == 0, by_profile.stderr
    assert by_profile.stdout.split()[:2] == ["None", "180"]


def test_a_heartbeat_frequency_the_user_set_is_kept(tmp_path: Path) -> None:
    done = _python(_HEARTBEAT, tmp_path, PREFECT_FLOWS_HEARTBEAT_FREQUENCY="60")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["60", "60"]


def test_the_det_executable_exits_with_mains_code(tmp_path: Path) -> None:
    done = _python(
        "import atexit, gc, sys\n"
        "from det_cli import command\n"
        "atexit.register(lambda: print('collector on:', gc.isenabled()))\n"
        "sys.argv = ['det', 'experiment', 'list']\n"
        "command()\n",
        tmp_path,
        PREFECT_API_URL="http://127.0.0.1:9/api",
    )
    # main's code for an unreachable platform, its message, and the collector off at exit.
    assert done.returncode == 1, done.stderr
    assert "no platform at http://127.0.0.1:9/api" in done.stderr
    assert done.stdout == "collector on: False\n"
