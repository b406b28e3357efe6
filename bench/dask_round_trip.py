"""A Dask step's submit-to-result time from the flow's client, at distributed's client
batching interval (10 ms) and at ours (cluster.startup.CLIENT_SEND_INTERVAL_S), interleaved on
one real scheduler and worker (processes, as the embedded cluster starts them).

Each step waits 15 ms after the previous one's release, as a trial's validate follows its
train (the flow logs, Prefect finishes one task and starts the next).

    python bench/dask_round_trip.py [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _step(x: int) -> int:
    return x + 1


def _median_ms(client: object, interval_s: float, steps: int) -> float:
    client.scheduler_comm.interval = interval_s  # type: ignore[attr-defined]
    times = []
    for i in range(steps):
        time.sleep(0.015)
        t0 = time.perf_counter()
        future = client.submit(_step, i, pure=False)  # type: ignore[attr-defined]
        future.result()
        future.release()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DET_TASKS_HOME", tempfile.mkdtemp())
    from distributed import Client

    from cluster.startup import CLIENT_SEND_INTERVAL_S, SCHEDULER_ENV, background_cluster

    default, ours = [], []
    with background_cluster(1), Client(os.environ[SCHEDULER_ENV]) as client:
        client.submit(_step, 0).result()  # the worker's first task imports and warms up
        for _ in range(args.repeats):
            default.append(_median_ms(client, 0.010, args.steps))
            ours.append(_median_ms(client, CLIENT_SEND_INTERVAL_S, args.steps))
    print(
        json.dumps(
            {
                "machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()}",
                "round_trip_ms_at_10ms": round(statistics.median(default), 2),
                f"round_trip_ms_at_{CLIENT_SEND_INTERVAL_S * 1000:g}ms": round(
                    statistics.median(ours), 2
                ),
                "raw": {"default": default, "ours": ours},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
