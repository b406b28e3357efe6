"""A single-trial experiment with no servers (``python -m flows.experiment``, MNIST CNN,
one embedded Dask worker) at Dask's one CPU thread per worker against the worker's share of
the cores (``det_tasks.cpu_threads``: every core for a lone worker), interleaved.

    python bench/worker_threads.py [--batches 300] [--repeats 2]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flow_latency import MNIST, run_in_home

from det_tasks.cpu_threads import WORKER_THREADS_ENV, available_cores


def _wall(batches: int, threads: int | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        done = run_in_home(
            Path(tmp),
            "flows.experiment",
            str(MNIST / "const.yaml"),
            f"searcher.max_length={{batches: {batches}}}",
            env={WORKER_THREADS_ENV: str(threads)} if threads else None,
        )
        wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"the flow failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    one, share = [], []
    for _ in range(args.repeats):
        one.append(_wall(args.batches, 1))
        share.append(_wall(args.batches, None))
    report = {
        "machine": f"{available_cores()} cores, load {os.getloadavg()}",
        "batches": args.batches,
        "one_thread_s": round(statistics.median(one), 2),
        "share_s": round(statistics.median(share), 2),
        "raw": {"one_thread": one, "share": share},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
