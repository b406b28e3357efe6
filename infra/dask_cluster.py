"""The stack's Dask cluster: a scheduler and warm worker processes that experiment flows run
their trials on (``DET_TASKS_DASK_SCHEDULER`` in the stack's env points flows at it).

Workers are started with Dask's own CLI (``dask worker``), one step at a time each (their
trials train on the host's cores shared out, ``DET_TASKS_WORKER_THREADS``), under a Nanny
(it restarts a killed or recycled worker), importing torch, the harness and the MLflow/S3
clients once at start (``--preload cluster.held_trials``). Each runs under
``infra.supervise``, which starts it again when it closes: a Dask worker closes for good
when its scheduler goes away, and the cluster must come back when the scheduler does.
``worker_service`` also serves a worker on another machine: give it that machine's working
directory and environment.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from cluster.pools import DEFAULT_POOL, POOL_ENV
from cluster.worker_spec import WorkerSpec, quiet_diagnostics_env
from det_tasks.cpu_threads import worker_share
from infra.services import Service, port_open

# Dask's setting ``distributed.scheduler.http.routes``: the modules whose routes it serves.
ROUTES_ENV = "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"

__all__ = [
    "registered_workers",
    "scheduler_address",
    "scheduler_answers",
    "scheduler_http_port",
    "scheduler_service",
    "worker_service",
    "worker_services",
]


def scheduler_address(port: int, host: str = "127.0.0.1") -> str:
    return f"tcp://{host}:{port}"


def scheduler_http_port(port: int) -> int:
    """The scheduler's HTTP port, next to its own (Dask's pairing: 8786, 8787): where
    ``det`` finds the job queue's routes (cluster.job_requests)."""
    return port + 1


def scheduler_service(
    root: Path,
    port: int,
    host: str = "127.0.0.1",
    preload: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Service:
    """``dask scheduler`` on ``host`` (loopback unless workers on other hosts need another
    address), its HTTP server on the next port serving the job queue's routes too
    (cluster.queue_http), importing ``preload`` (a scheduler plugin's module, with its
    settings in ``env``). A lost worker fails its task at once (allowed-failures 0): the
    experiment's task retries (max_restarts) decide."""
    from cluster.queue_http import route_modules

    argv = [
        sys.executable, "-m", "distributed.cli.dask_scheduler",
        "--host", host, "--port", str(port),
        "--dashboard-address", f"{host}:{scheduler_http_port(port)}",
        *(arg for module in preload for arg in ("--preload", module)),
    ]  # fmt: skip
    return Service(
        "dask-scheduler",
        argv,
        lambda: port_open(port, host) and scheduler_answers(scheduler_address(port, host)),
        root,
        # Steps are placed where their trial is held: no work stealing.
        env={
            **quiet_diagnostics_env(),
            "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
            "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False",
            ROUTES_ENV: repr(route_modules()),
            **(env or {}),
        },
        start_timeout_s=60,
        stop_timeout_s=15,
    )


def worker_service(
    root: Path,
    scheduler: str,
    name: str,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    gpus: list[int] | None = None,
    threads: int = 1,
    pool: str | None = None,
) -> Service:
    """One worker process (one trial at a time) joined to ``scheduler``, running in
    ``workdir`` (its own folder, as on another host) with ``env`` added, its trials training
    on ``threads`` CPU threads; with ``gpus`` it sees only those GPUs and advertises them as
    the Dask resource ``GPU`` (cluster.devices). It joins resource pool ``pool`` (default:
    DET_TASKS_RESOURCE_POOL, else ``default``), named by its Dask resource ``pool-<name>``
    (cluster.pools)."""
    folder = workdir or root / name
    folder.mkdir(parents=True, exist_ok=True)
    spec = WorkerSpec(
        threads=threads,
        gpus=tuple(gpus) if gpus is not None else None,
        pool=pool or os.environ.get(POOL_ENV) or DEFAULT_POOL,
        preload=("cluster.held_trials",),  # torch, the harness, the clients: once, at start
    )
    spec_env = spec.cli_env()
    own_gpus = {k: spec_env.pop(k) for k in ["CUDA_VISIBLE_DEVICES"] if k in spec_env}
    argv = [
        # Under a supervisor: a worker closes for good when it loses its scheduler (a
        # restart, its host lost), and must come back by itself once it answers again.
        sys.executable, "-m", "infra.supervise", name, "--",
        sys.executable, "-m", "distributed.cli.dask_worker", scheduler,
        "--name", name,
        "--local-directory", str(folder / "dask"), "--dashboard-address", ":0",
        *spec.cli_args(),
    ]  # fmt: skip
    return Service(
        name,
        argv,
        # Up means what the flows need: the scheduler lists a worker of this name.
        lambda: name in registered_workers(scheduler),
        root,
        env={
            "DET_TASKS_CACHE_DIR": str(folder / "cache"),
            "TMPDIR": str(_mkdir(folder / "tmp")),
            **quiet_diagnostics_env(),
            **spec_env,  # its threads, and non-daemonic (cluster.worker_spec)
            **(env or {}),
            **own_gpus,
        },
        start_timeout_s=120,
        stop_timeout_s=20,
        cwd=folder,
    )


def worker_services(
    root: Path, scheduler: str, env: dict[str, str], count: int | None = None
) -> list[Service]:
    """``count`` workers of this host (None: ``DET_TASKS_DASK_WORKERS``, default 2)."""
    if count is None:
        count = int(os.environ.get("DET_TASKS_DASK_WORKERS", "2"))
    if count == 0:
        return []
    threads = worker_share(count)
    return [
        worker_service(root, scheduler, f"dask-worker-{i}", env=env, threads=threads)
        for i in range(count)
    ]


def registered_workers(scheduler: str, timeout_s: float = 3.0) -> set[str]:
    """Names of the workers the scheduler at ``scheduler`` lists now (none when it cannot
    be reached): asked of the scheduler itself, so a status or a start-up wait sees what
    flows would see."""
    identity = _scheduler_identity(scheduler, timeout_s)
    return {str(w.get("name")) for w in (identity or {}).get("workers", {}).values()}


def scheduler_answers(scheduler: str, timeout_s: float = 3.0) -> bool:
    """Whether a Dask scheduler answers at ``scheduler``: its health check. An open port is
    not enough: the port after a scheduler's is its HTTP server (cluster.queue_http)."""
    return _scheduler_identity(scheduler, timeout_s) is not None


def _scheduler_identity(scheduler: str, timeout_s: float) -> dict[str, Any] | None:
    """The scheduler's own description (its workers among it), or None when no Dask
    scheduler answers there."""
    from distributed.core import rpc

    async def ask() -> Any:
        async with rpc(scheduler, timeout=timeout_s) as remote:
            return await remote.identity()

    try:
        identity = asyncio.run(asyncio.wait_for(ask(), timeout_s))
    except (OSError, TimeoutError):
        return None
    except Exception:  # something else answered on that address (not a Dask scheduler)
        return None
    if isinstance(identity, dict) and identity.get("type") == "Scheduler":
        return identity
    return None


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
