"""Our Dask workers run without Dask's memory limit. With its default (RAM / workers) a
worker past 80% is paused and silently stops running steps: 32 trial workers on a 23 GB host
(0.79 GB each, 0.68 GB used by torch and a model) all paused and the experiment hung."""

from __future__ import annotations

import os
from typing import Any

from distributed import Client

from flows.engine import embedded_cluster


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
