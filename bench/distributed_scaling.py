"""Data-parallel scaling through `det-tasks run`: samples/s of a compute-bound conv net
(global batch 64) with 2 workers vs 1, for torch.distributed (DDP) and Horovod, measured
side by side in one run. Start-up (imports, rendezvous) is cancelled out by timing a short
and a long run of each configuration and dividing the extra batches by the extra time.
Every process gets one thread (OMP_NUM_THREADS=1), as in ../shared/FACTS.md's plain-script
figures on this 2-core machine. A plain DDP loop over the same model (no harness, data
already in memory) is measured alongside, so the machine's own scaling is visible.

    python bench/distributed_scaling.py [--short 10] [--long 70]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "distributed_model"
GLOBAL_BATCH = 64


def timed_run(slots: int, backend: str, batches: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        argv = [
            sys.executable, "-m", "det_tasks.runner.cli", "run", str(MODEL / "conv.yaml"),
            "--no-progress", "--checkpoint-dir", out,
            "--param", f"resources.slots_per_trial={slots}",
            "--param", f"resources.distributed_backend={backend}",
            "--param", f"searcher.max_length={{batches: {batches}}}",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{backend} x{slots} failed:\n{proc.stderr[-3000:]}")
        return elapsed


def throughput(slots: int, backend: str, short: int, long: int) -> float:
    t_short = min(timed_run(slots, backend, short) for _ in range(2))
    t_long = min(timed_run(slots, backend, long) for _ in range(2))
    return (long - short) * GLOBAL_BATCH / (t_long - t_short)


def plain_ddp(slots: int) -> float:
    script = str(MODEL / "plain_ddp.py")
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(slots),
        ]
        if slots > 1
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.run([*launcher, script], capture_output=True, text=True, env=env)
        for _ in range(2)
    ]
    return max(float(r.stdout.strip().splitlines()[-1]) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=70)
    args = parser.parse_args()
    backends = ["torch"] + (["horovod"] if importlib.util.find_spec("horovod") else [])
    one = throughput(1, "torch", args.short, args.long)
    print(f"1 process (no backend): {one:8.1f} samples/s")
    results = {}
    for backend in backends:
        results[backend] = throughput(2, backend, args.short, args.long)
        print(
            f"2 x {backend:8s}: {results[backend]:8.1f} samples/s   "
            f"scaling {results[backend] / one:.2f}x (target >= 1.7x)"
        )
    plain_one, plain_two = plain_ddp(1), plain_ddp(2)
    print(
        f"plain loop, 1 process: {plain_one:8.1f} samples/s; plain DDP x2: {plain_two:8.1f} "
        f"samples/s (scaling {plain_two / plain_one:.2f}x)"
    )
    for backend, value in results.items():
        print(f"harness x2 {backend} / plain DDP x2: {value / plain_two:.2f}")
    if len(results) == 2:
        print(f"horovod / torch at 2 workers: {results['horovod'] / results['torch']:.2f}")
    print(f"machine: {os.cpu_count()} CPUs, torch threads per process: 1")


if __name__ == "__main__":
    main()
