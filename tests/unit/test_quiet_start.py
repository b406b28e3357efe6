"""A new user's first ``det`` command or ``python -m flows.experiment`` in a terminal prints
no third-party notice: Prefect shows its telemetry notice on its first import in a terminal
(a fresh Prefect home, no CI), which ``det experiment create`` printed. The same import
without them shows it, so the check can see it. And ``make install`` prints no setuptools
notice."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prefect._internal.analytics.ci_detection import CI_ENV_VARS

NOTICE = "Prefect collects anonymous usage data"


def in_a_terminal(code: str, home: Path) -> str:
    """What ``python -c CODE`` prints to a terminal, with a fresh Prefect home."""
    env = {k: v for k, v in os.environ.items() if k not in CI_ENV_VARS and k != "DO_NOT_TRACK"}
    home.mkdir()
    env.update(PREFECT_HOME=str(home / "prefect"), HOME=str(home))
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=follower, stderr=follower, env=env
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0, b"".join(chunks)[-2000:]
    finally:
        os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_det_and_the_flow_show_no_prefect_telemetry_notice(tmp_path):
    plain = in_a_terminal("import prefect", tmp_path / "plain")
    assert NOTICE in plain  # what a new user saw
    # det's entry point, and the package `python -m flows.experiment` starts from.
    for entry in ("det_cli", "flows"):
        shown = in_a_terminal(f"import {entry}, prefect", tmp_path / entry)
        assert NOTICE not in shown and shown.strip() == "", (entry, shown)


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("det_tasks", "registry", "cluster", "flows", "det_cli", "infra")


@pytest.mark.slow  # a venv, pip's upgrade and a build from the package index: about a minute
def test_the_makefiles_editable_install_prints_no_setuptools_notice(tmp_path):
    """`make demo`'s install printed setuptools' "Editable installation" BuildBackendWarning.
    The Makefile's own commands (its venv, pip upgrade and editable install lines, the
    install without the dependencies) into a scratch venv, from a copy of the project."""
    venv = tmp_path / "venv"
    listed = subprocess.run(
        ["make", "-n", "-B", "install", f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    make_venv = next(line for line in listed if " -m venv " in line)
    upgrade_pip = next(line for line in listed if " --upgrade pip" in line)
    (install,) = [line for line in listed if " install " in line and " -e " in line]
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, project / package, ignore=shutil.ignore_patterns("__pycache__")
        )

    def run(command: str) -> str:
        done = subprocess.run(
            command, shell=True, cwd=project, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    run(make_venv)
    run(upgrade_pip)  # the pip that shows a build backend's warnings
    output = run(f"{install} --no-deps")
    assert "Editable installation" not in output and "BuildBackendWarning" not in output, output
    # The same install without the Makefile's filter shows the notice, so it is seen here.
    plain = install.removeprefix('PYTHONWARNINGS="ignore:Editable installation" ')
    assert plain != install
    assert "Editable installation" in run(f"{plain} --no-deps --force-reinstall")
