"""Warm services kept between runs (``python -m infra.warm_home start``, as ``ray start``):
a later ``python -m flows.experiment`` runs its flow on the warm Prefect server and its
trial on a warm Dask worker, records to the home's MLflow store as without them, and
``stop`` leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import env_without_platform

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "tests" / "fixtures" / "flow_model" / "grid.yaml"


def _env(tmp_path: Path) -> dict[str, str]:
    return env_without_platform(
        DET_TASKS_HOME=str(tmp_path / "det"),
        PREFECT_HOME=str(tmp_path / "prefect"),
        PYTHONPATH=str(REPO),
    )


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _worker_addresses(scheduler: str) -> set[str]:
    from distributed.core import rpc

    async def ask() -> set[str]:
        async with rpc(scheduler, timeout=5) as remote:
            identity = await remote.identity()
        return set(identity["workers"])

    return asyncio.run(ask())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_later_runs_use_the_warm_services_and_stop_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from registry.tracking import client_for

    started = _run(tmp_path, "infra.warm_home", "start")
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        recorded = json.loads((tmp_path / "det" / "warm" / "services.json").read_text())
        api, scheduler = recorded["PREFECT_API_URL"], recorded["DET_TASKS_DASK_SCHEDULER"]
        warm_workers = _worker_addresses(scheduler)
        assert len(warm_workers) == 2

        proc = _run(tmp_path, "flows.experiment", str(GRID), "searcher.max_trials=1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "on the warm services of" in proc.stderr
        assert "Starting temporary server" not in proc.stderr
        # The flow ran on the warm server, and it holds the run as completed.
        flow_run = re.search(r"View at (http://\S+)/runs/flow-run/([0-9a-f-]+)", proc.stderr)
        assert flow_run is not None and f"{flow_run.group(1)}/api" == api
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run.group(2)}") as response:
            assert json.load(response)["state"]["type"] == "COMPLETED"
        # Every step ran on a warm worker; none was started for the run.
        places = set(
            re.findall(r"trial \d+ \(MLflow run \w+\) \w+ .* on (tcp://[\d.:]+)", proc.stderr)
        )
        assert places and places <= warm_workers
        assert _worker_addresses(scheduler) == warm_workers
        # It recorded to the home's store, as a run without warm services does.
        summary = json.loads(proc.stdout)
        client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
        experiment = client.get_experiment_by_name("flow-grid")
        assert experiment is not None
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
        trial = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
        assert summary["best"]["metric"] == pytest.approx(
            trial.data.metrics["validation/validation_loss"]
        )
    finally:
        pid_files = list((tmp_path / "det" / "warm" / "pids").glob("*.pid"))
        pids = [int(p.read_text()) for p in pid_files]
        stopped = _run(tmp_path, "infra.warm_home", "stop")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert len(pids) == 4  # the Prefect server, the scheduler, two workers
    assert not [pid for pid in pids if _pid_alive(pid)]
    assert not (tmp_path / "det" / "warm" / "services.json").exists()
    status = _run(tmp_path, "infra.warm_home", "status")
    assert "no warm services" in status.stdout
