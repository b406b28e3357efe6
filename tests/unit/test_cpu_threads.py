"""Warm Dask workers share the host's cores out instead of Dask's one thread each."""

from __future__ import annotations

from pathlib import Path

import pytest

from det_tasks.cpu_threads import WORKER_THREADS_ENV, threads_per_process
from infra.dask_cluster import worker_service, worker_services


@pytest.mark.parametrize(("processes", "threads"), [(1, 8), (2, 4), (3, 2), (8, 1), (16, 1)])
def test_the_cores_are_shared_out_at_least_one_each(
    processes: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert threads_per_process(processes) == threads


def test_stack_workers_are_told_their_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("DET_TASKS_DASK_WORKERS", "2")
    pool = worker_services(tmp_path, "tcp://127.0.0.1:1", {})
    assert [s.env[WORKER_THREADS_ENV] for s in pool] == ["4", "4"]
    lone = worker_service(tmp_path, "tcp://127.0.0.1:1", "w", threads=8)
    assert lone.env[WORKER_THREADS_ENV] == "8"
