"""Our Dask workers run without Dask's memory limit. With its default (RAM / workers) a
worker past 80% is paused and silently stops running steps: 32 trial workers on a 23 GB host
(0.79 GB each, 0.68 GB used by torch and a model) all paused and the experiment hung.
Instead an embedded cluster starts no more workers than the host's available memory holds:
past that, the operating system kills workers mid-trial."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from distributed import Client

from cluster.startup import (
    DEFAULT_WORKER_MEMORY_MB,
    EXPECTED_WORKERS_ENV,
    WORKER_MEMORY_ENV,
    background_cluster,
    embedded_cluster,
    workers_that_fit,
)
from tests.integration.helpers import env_without_platform

ROOT = Path(__file__).resolve().parents[2]


def _limits(client: Client) -> list[Any]:
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return [(w["memory_limit"], w["status"]) for w in workers]


def test_embedded_cluster_workers_have_no_memory_limit() -> None:
    with embedded_cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        assert _limits(client) == [(0, "running"), (0, "running")]


def test_stack_workers_have_no_memory_limit(stack: Any) -> None:
    with Client(os.environ["DET_TASKS_DASK_SCHEDULER"], timeout=30) as client:
        limits = _limits(client)
    assert limits and all(limit == (0, "running") for limit in limits), limits


def test_workers_fit_the_hosts_available_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    available_mb = psutil.virtual_memory().available // 2**20
    monkeypatch.delenv(WORKER_MEMORY_ENV, raising=False)
    assert available_mb > DEFAULT_WORKER_MEMORY_MB * 4  # this machine holds 4 default workers
    assert workers_that_fit(4) == 4
    # Workers a third of the available memory each: 3 start (give or take what other
    # processes free or take meanwhile), and the warning says why and what to change.
    monkeypatch.setenv(WORKER_MEMORY_ENV, str(available_mb // 3))
    with caplog.at_level(logging.WARNING, logger="cluster.startup"):
        assert workers_that_fit(8) in (2, 3, 4)
    assert WORKER_MEMORY_ENV in caplog.text and "max_concurrent_trials" in caplog.text
    # More than the host has: still one worker, so the experiment runs its trials in turn.
    monkeypatch.setenv(WORKER_MEMORY_ENV, str(available_mb * 4))
    assert workers_that_fit(8) == 1


def test_an_embedded_cluster_starts_only_the_workers_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(WORKER_MEMORY_ENV, str(psutil.virtual_memory().total // 2**20))
    with background_cluster(3) as address, Client(address, timeout=60) as client:
        # The flow's client waits for this many workers (not 3, which would never come).
        assert os.environ[EXPECTED_WORKERS_ENV] == "1"
        client.wait_for_workers(1, timeout=120)
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 1


@pytest.mark.parametrize("value", ["lots", "0", "-5"])
def test_a_bad_worker_memory_setting_is_refused_before_anything_starts(value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(ROOT / "examples/mnist/const.yaml")],
        env=env_without_platform(**{WORKER_MEMORY_ENV: value}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{WORKER_MEMORY_ENV}={value!r}" in proc.stderr
    assert "positive whole number of megabytes" in proc.stderr
    assert "Traceback" not in proc.stderr
