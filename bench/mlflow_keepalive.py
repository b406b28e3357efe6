"""An MLflow client call against the stack's MLflow server on asyncio's event loop and on
uvloop (what infra.stack runs it on), side by side in one run, rounds interleaved.

The stack runs MLflow's server with uvicorn's ``--workers 2``. uvicorn then binds the
listening socket itself, with protocol number 0, and asyncio's transports set TCP_NODELAY
only on sockets whose protocol is IPPROTO_TCP. So the workers' sockets kept Nagle's
algorithm, and each response's body, written just after its headers, waited for the
client's delayed ACK (~40 ms on Linux) on every request of a kept-alive connection; a new
connection's first request did not (the kernel acknowledges at once then). uvloop sets
TCP_NODELAY on every TCP socket. Each server: ``--workers 2`` as the stack's, a SQLite store
of its own, one MLflow experiment with one run; each round times ``--calls`` calls of each
kind on one ``MlflowClient`` (kept-alive connections, as a flow's and a trial's client).

    python bench/mlflow_keepalive.py [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mlflow_server import mlflow_server

LOOPS = ("asyncio", "uvloop")


def stack_like_server(root: Path, loop: str) -> tuple[subprocess.Popen[bytes], str]:
    """An MLflow server as the stack starts it (two uvicorn workers), on event loop ``loop``."""
    opts = f"--loop {loop} --timeout-worker-healthcheck 120"
    return mlflow_server(root, "--workers", "2", "--uvicorn-opts", opts)


def calls(client: Any) -> dict[str, Callable[[], Any]]:
    """The kinds of call a flow makes most, on an experiment and run of their own."""
    experiment_id = client.create_experiment(f"keepalive-{os.getpid()}")
    run_id = client.create_run(experiment_id).info.run_id
    query = "tags.`det.trial_id` = '1'"
    return {
        "get run": lambda: client.get_run(run_id),
        "search runs": lambda: client.search_runs([experiment_id], query, max_results=2),
        "set tag": lambda: client.set_tag(run_id, "bench.tag", "1"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    from mlflow.tracking import MlflowClient

    servers: list[subprocess.Popen[bytes]] = []
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="mlflow-keepalive-") as folder:
        try:
            kinds = {}
            for loop in LOOPS:
                root = Path(folder) / loop
                root.mkdir()
                proc, uri = stack_like_server(root, loop)
                servers.append(proc)
                kinds[loop] = calls(MlflowClient(uri))
            before = os.getloadavg()[0]
            for _ in range(args.rounds):
                for loop in LOOPS:
                    for kind, call in kinds[loop].items():
                        for _ in range(args.calls):
                            start = time.perf_counter()
                            call()
                            times.setdefault((loop, kind), []).append(time.perf_counter() - start)
        finally:
            for proc in servers:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    print(f"load average (1 min) before {before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{platform.node()} ({os.cpu_count()} CPUs); {args.rounds} rounds x {args.calls} "
          "calls of each kind, one kept-alive client per server; median ms (p90)")  # fmt: skip
    for kind in kinds[LOOPS[0]]:
        cells = []
        for loop in LOOPS:
            ms = sorted(t * 1000 for t in times[(loop, kind)])
            cells.append(f"{loop} {statistics.median(ms):.1f} ({ms[int(len(ms) * 0.9)]:.1f})")
        ratio = statistics.median(times[(LOOPS[0], kind)]) / statistics.median(
            times[(LOOPS[1], kind)]
        )
        print(f"{kind}: " + "; ".join(cells) + f"; asyncio / uvloop {ratio:.1f}x")


if __name__ == "__main__":
    main()
