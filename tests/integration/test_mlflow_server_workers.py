"""The stack's MLflow server keeps a worker that is slow to answer uvicorn's health ping,
and its workers run on uvloop.

uvicorn's supervisor kills a worker that does not answer within 5 s by default, and pings
the replacement while it is still importing MLflow: under a 32-trial load on 2 cores that
killed a worker mid-response and then restarted workers every 6 s (CI, stop 22). On
asyncio's loop the workers' sockets lacked TCP_NODELAY, which cost every request on a
kept-alive connection ~40 ms (bench/mlflow_keepalive.py)."""

from __future__ import annotations

import os
import signal
import time

import psutil

from infra.services import http_ok
from infra.stack import StackConfig, mlflow_service


def uvicorn_workers(config: StackConfig) -> list[psutil.Process]:
    server = psutil.Process(int(mlflow_service(config).pidfile.read_text()))
    commands = {p: " ".join(p.cmdline()) for p in server.children(recursive=True)}
    return [p for p, c in commands.items() if "spawn_main" in c and "resource_tracker" not in c]


def test_a_worker_silent_for_longer_than_uvicorns_default_healthcheck_is_kept(stack):
    workers = uvicorn_workers(stack)
    assert len(workers) == 2
    silent = workers[0]
    os.kill(silent.pid, signal.SIGSTOP)
    try:
        time.sleep(8)  # uvicorn's default: killed after 5 s without a pong
    finally:
        os.kill(silent.pid, signal.SIGCONT)
    assert silent.is_running() and silent.status() != psutil.STATUS_ZOMBIE
    assert sorted(p.pid for p in uvicorn_workers(stack)) == sorted(p.pid for p in workers)
    assert http_ok(f"{stack.mlflow_uri}/health")


def test_the_workers_run_on_uvloop(stack):
    workers = uvicorn_workers(stack)
    assert workers
    for worker in workers:
        libraries = {m.path for m in worker.memory_maps()}
        assert any("/uvloop/" in path for path in libraries), (worker.pid, worker.cmdline())
