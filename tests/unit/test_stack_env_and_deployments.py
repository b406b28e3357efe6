"""What ``make up`` leaves a user without starting anything: ``.stack/env`` puts this
installation's ``det`` on PATH in a shell with nothing activated, and the deployments'
fingerprint and checks that let a second ``make up`` skip ``prefect deploy``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

from infra import deployments
from infra.stack import StackConfig, env_file_text

REPO = Path(__file__).resolve().parents[2]


def test_sourcing_the_env_file_finds_det_and_python_of_this_installation(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text(env_file_text(StackConfig(root=tmp_path / "stack")))
    found = subprocess.run(
        ["/bin/bash", "--noprofile", "--norc", "-c",
         f". {env_file} && command -v det det-tasks python && echo $PREFECT_API_URL"],
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    scripts = Path(sys.executable).parent
    assert found.stdout.split() == [
        str(scripts / "det"),
        str(scripts / "det-tasks"),
        str(scripts / "python"),
        "http://127.0.0.1:4200/api",
    ]


def test_the_env_file_keeps_the_system_path_after_the_scripts(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text(env_file_text(StackConfig(root=tmp_path / "stack")))
    path = subprocess.run(
        ["/bin/sh", "-c", f". {env_file} && echo $PATH"],
        env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    assert path == f"{Path(sys.executable).parent}:/usr/bin:/bin"


def test_wanted_reads_every_deployment_of_prefect_yaml():
    found = deployments.wanted(REPO)
    assert ("submitted", "flows.experiment.experiment") in found
    assert ("submitted", "flows.batch_inference.batch_inference") in found
    assert ("const", "flows.experiment.experiment") in found


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "flows").mkdir(parents=True)
    shutil.copy(REPO / "prefect.yaml", project)
    for module in ("experiment", "batch_inference"):
        (project / "flows" / f"{module}.py").write_text(f"def {module}(config: str): ...\n")
    return project


def test_the_fingerprint_follows_prefect_yaml_and_flow_signatures_not_flow_bodies(tmp_path):
    project = _project(tmp_path)
    first = deployments.fingerprint(project)
    flow = project / "flows" / "experiment.py"
    flow.write_text("import os\n\n\ndef experiment(config: str):\n    return os.sep\n")
    assert deployments.fingerprint(project) == first  # a body: workers import it anyway
    flow.write_text("def experiment(config: str, overrides: list[str]): ...\n")
    second = deployments.fingerprint(project)
    assert second != first  # a parameter: the registered schema is stale
    flow.write_text('def experiment(config: str, overrides: list[str]):\n    """Now."""\n')
    third = deployments.fingerprint(project)
    assert third != second  # the docstring: Prefect's parameter descriptions
    (project / "prefect.yaml").write_text((project / "prefect.yaml").read_text() + "\n# edit\n")
    assert deployments.fingerprint(project) not in (first, second, third)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_not_current_without_a_stamp_or_with_a_stale_one_or_without_a_server(tmp_path):
    project = _project(tmp_path)
    api = f"http://127.0.0.1:{_closed_port()}/api"
    stamp = tmp_path / "deployed"
    assert not deployments.is_current(stamp, project, api)
    stamp.write_text("0" * 64 + "\n")
    assert not deployments.is_current(stamp, project, api)
    stamp.write_text(deployments.fingerprint(project) + "\n")
    # The stamp matches, but no server answers: register (and let that report the fault).
    assert not deployments.on_server(api, deployments.wanted(project))
    assert not deployments.is_current(stamp, project, api)
