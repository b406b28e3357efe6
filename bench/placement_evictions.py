"""How often a trial's held state is evicted mid-segment, and the wall time, for the ASHA
search of tests/fixtures/flow_model (8 trials, 2 at a time, rungs at 16/32/64 batches), run
side by side from several checkouts, repeats interleaved.

An eviction mid-segment is a validate or checkpoint step that had to restore its trial
(``validated at batch 16 ... (restored from ...)``): another trial's step ran on the worker
between this trial's steps. Each one replays the trial from its checkpoint (exact, but
paid for), and two trials started on one worker evict each other at every step. Each run is
``python -m flows.experiment`` with no servers configured (embedded Prefect server, MLflow
SQLite store, 2 single-threaded Dask workers, as bench/flow_latency.py), checkpoints on the
local disk.

    python bench/placement_evictions.py [--repeats 5] [--checkout PATH ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_flow_latency = importlib.import_module("flow_latency")
ROOT: Path = _flow_latency.ROOT
no_server_env = _flow_latency.no_server_env

CONFIG = Path("tests/fixtures/flow_model/asha.yaml")
EVICTED = re.compile(r"(validated|checkpoint) at batch \d+ .*\(restored from ")


def run_once(checkout: Path, index: int) -> tuple[float, int]:
    """One search from ``checkout``: its wall seconds and its mid-segment evictions."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        overrides = [
            f"name=placement-bench-{index}",
            f"checkpoint_storage={{type: shared_fs, host_path: {home / 'checkpoints'}}}",
        ]
        env = {**no_server_env(home), "PYTHONPATH": str(checkout)}
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "flows.experiment", str(checkout / CONFIG), *overrides],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{checkout}: the flow failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall, sum(1 for line in done.stderr.splitlines() if EVICTED.search(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkout", type=Path, action="append", default=[])
    args = parser.parse_args()
    checkouts = [c.resolve() for c in args.checkout] or [ROOT]
    walls: dict[Path, list[float]] = {c: [] for c in checkouts}
    evictions: dict[Path, list[int]] = {c: [] for c in checkouts}
    for repeat in range(args.repeats):
        for checkout in checkouts:
            wall, evicted = run_once(checkout, repeat)
            walls[checkout].append(wall)
            evictions[checkout].append(evicted)
            print(f"{checkout}: run {repeat + 1}: {wall:.1f} s, {evicted} eviction(s)", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for checkout in checkouts:
        print(
            f"{checkout}: wall median {statistics.median(walls[checkout]):.1f} s "
            f"({min(walls[checkout]):.1f}-{max(walls[checkout]):.1f}); evictions per run "
            f"{evictions[checkout]} (total {sum(evictions[checkout])})"
        )


if __name__ == "__main__":
    main()
