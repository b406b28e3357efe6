"""The stack on ports other than the defaults (the test stack's): the Prefect UI is told its
own server's address, and ``python -m infra.stack status`` reports what really runs,
the Dask workers included."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import urllib.request

from infra.stack import StackConfig, service_states


def test_prefect_ui_is_told_its_own_servers_port(stack: StackConfig):
    assert stack.prefect_port != 4200
    url = f"http://127.0.0.1:{stack.prefect_port}/ui-settings"
    with urllib.request.urlopen(url, timeout=10) as resp:
        settings = json.load(resp)
    assert settings["api_url"] == f"http://127.0.0.1:{stack.prefect_port}/api"


def stack_env(config: StackConfig) -> dict[str, str]:
    """What a user exports to point ``python -m infra.stack`` at this stack."""
    ports = {
        "S3": config.s3_port,
        "SEAWEED_MASTER": config.master_port,
        "SEAWEED_VOLUME": config.volume_port,
        "SEAWEED_FILER": config.filer_port,
        "MLFLOW": config.mlflow_port,
        "PREFECT": config.prefect_port,
        "DASK": config.dask_port,
    }
    return {
        **os.environ,
        "DET_TASKS_STACK_DIR": str(config.root),
        **{f"DET_TASKS_{name}_PORT": str(port) for name, port in ports.items()},
        "DET_TASKS_SEAWEED_GRPC_SHIFT": str(config.seaweed_grpc_shift),
    }


def test_status_reports_every_running_service_up(stack: StackConfig):
    proc = subprocess.run(
        [sys.executable, "-m", "infra.stack", "status"],
        env=stack_env(stack),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    states = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()}
    assert states == {
        "seaweedfs": "up",
        "mlflow": "up",
        "dask-scheduler": "up",
        "dask-worker-0": "up",
        "dask-worker-1": "up",
        "prefect-server": "up",
        "flow-starter": "up",
        "prefect-worker": "up",
    }, proc.stdout


def test_status_asks_the_scheduler_not_the_pid_files(stack: StackConfig):
    """The workers' processes run, but a scheduler on another port does not list them."""
    elsewhere = dataclasses.replace(stack, dask_port=stack.dask_port + 1)
    states = {service.name: state for service, state in service_states(elsewhere)}
    assert states["dask-scheduler"] == "down"
    assert states["dask-worker-0"] == states["dask-worker-1"] == "down"
    assert states["mlflow"] == "up"
