"""Warm services kept between runs (``python -m infra.warm_home start``, as ``ray start``):
a later ``python -m flows.experiment`` runs its flow on the warm Prefect server and its
trial on a warm Dask worker, records to the home's MLflow store as without them, stops on
Ctrl-C as it does without them (leaving the workers warm and idle), and ``stop`` leaves no
process behind."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import FLOW_MODEL, ctrl_c_midway, group_alive, home_env

GRID = FLOW_MODEL / "grid.yaml"
KILLABLE = FLOW_MODEL / "killable.yaml"  # 120 batches
SLOW = ["hyperparameters.sleep_s=0.1"]  # 12 s of training: time to stop it midway


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=tmp_path,
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _ask_scheduler(scheduler: str, handler: str) -> Any:
    """One of the scheduler's own handlers (``identity``, ``processing``), as Dask's CLI
    and dashboard ask it."""
    from distributed.core import rpc

    async def ask() -> Any:
        async with rpc(scheduler, timeout=5) as remote:
            return await getattr(remote, handler)()

    return asyncio.run(ask())


def _worker_addresses(scheduler: str) -> set[str]:
    return set(_ask_scheduler(scheduler, "identity")["workers"])


def _busy_workers(scheduler: str) -> dict[str, list[str]]:
    """Each worker's tasks in flight, as the scheduler sees them."""
    processing = _ask_scheduler(scheduler, "processing")
    return {worker: list(keys) for worker, keys in processing.items() if keys}


def _ctrl_c_midway(tmp_path: Path) -> tuple[int, str, float]:
    """A 12 s trial on the warm services, SIGINT to its terminal's process group midway:
    the exit code, stderr, and seconds from the signal to the exit."""
    pid_file = tmp_path / "pids"
    args = [str(KILLABLE), *SLOW, f"data.pid_file={pid_file}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", *args],
        cwd=tmp_path,
        env=home_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    stderr, took = ctrl_c_midway(proc, pid_file, after_s=3)
    return proc.returncode, stderr, took


def test_later_runs_use_the_warm_services_and_stop_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from registry.runs.tracking import client_for

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

        # Ctrl-C stops the run as without warm services: checkpointed, runs KILLED, within
        # seconds; the trial leaves the warm worker, which stays up for the next run.
        code, stderr, took = _ctrl_c_midway(tmp_path)
        assert code == 130 and "--activate" in stderr, stderr[-3000:]
        assert "on the warm services of" in stderr
        assert took <= 30, f"exit took {took:.1f} s"
        killable = client.get_experiment_by_name("flow-killable")
        assert killable is not None
        stopped = client.search_runs([killable.experiment_id])
        assert stopped and {r.info.status for r in stopped} == {"KILLED"}
        assert _busy_workers(scheduler) == {}
        assert _worker_addresses(scheduler) == warm_workers
    finally:
        pid_files = list((tmp_path / "det" / "warm" / "pids").glob("*.pid"))
        pids = [int(p.read_text()) for p in pid_files]
        stopped = _run(tmp_path, "infra.warm_home", "stop")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert len(pids) == 4  # the Prefect server, the scheduler, two workers
    # No live process: an exited one the machine's init has yet to reap (a zombie) is gone.
    assert not [pid for pid in pids if group_alive(pid)]
    assert not (tmp_path / "det" / "warm" / "services.json").exists()
    status = _run(tmp_path, "infra.warm_home", "status")
    assert "no warm services" in status.stdout
