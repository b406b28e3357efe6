"""Warm Dask workers share the host's cores out instead of Dask's one thread each."""

from __future__ import annotations

from pathlib import Path

import pytest

from det_tasks.cpu_threads import WORKER_THREADS_ENV, threads_per_process, worker_threads
from det_tasks.errors import ConfigError
from det_tasks.runner.worker_group import worker_env
from infra.dask_cluster import worker_service, worker_services


@pytest.mark.parametrize(("processes", "threads"), [(1, 8), (2, 4), (3, 2), (8, 1), (16, 1)])
def test_the_cores_are_shared_out_at_least_one_each(processes: int, threads: int) -> None:
    assert threads_per_process(processes, cores=8) == threads


def test_stack_workers_are_told_their_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("det_tasks.cpu_threads.available_cores", lambda: 8)
    monkeypatch.setenv("DET_TASKS_DASK_WORKERS", "2")
    pool = worker_services(tmp_path, "tcp://127.0.0.1:1", {})
    assert [s.env[WORKER_THREADS_ENV] for s in pool] == ["4", "4"]
    lone = worker_service(tmp_path, "tcp://127.0.0.1:1", "w", threads=8)
    assert lone.env[WORKER_THREADS_ENV] == "8"


@pytest.mark.parametrize("text", ["abc", "0", "-2", "1.5"])
def test_a_bad_thread_count_names_the_variable(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKER_THREADS_ENV, text)
    with pytest.raises(ConfigError, match=f"{WORKER_THREADS_ENV}='{text}'"):
        worker_threads()


def test_a_multi_slot_trial_on_a_worker_splits_the_workers_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside a worker the Nanny's OMP_NUM_THREADS=1 is not the user's: the ranks of a
    2-slot trial on a worker owning 4 cores get 2 each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(WORKER_THREADS_ENV, "4")
    assert worker_env(2, "torch")["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv(WORKER_THREADS_ENV)
    assert worker_env(2, "torch")["OMP_NUM_THREADS"] == "1"  # the user's own setting
