"""A training step on a warm Dask worker vs the same step in a plain process, side by side.

Dask's nanny starts its workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which turns off
glibc's dynamic mmap threshold: every allocation over 128 KiB (a batch, a layer's
activations) is mapped afresh and page-faulted in on every step. Trial steps therefore run
inside ``cluster.worker_heap.reuse_freed_memory()`` (``cluster.held_trials.run_step``). This prints,
for the MNIST tutorial's CNN at batch 64 on one CPU thread, the training thread's CPU time
and minor page faults per step in three places, interleaved, medians of the repeats:

- this process (a plain PyTorch loop, glibc's defaults);
- an embedded Dask worker as Dask leaves it;
- the same worker inside ``reuse_freed_memory()``, as trial steps run now.

    python bench/worker_heap.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cnn_steps(model: Any, steps: int, raised: bool) -> tuple[float, float]:
    """CPU ms and minor page faults per step of ``model``'s training, after 20 warm-up
    steps; ``raised``: inside reuse_freed_memory()."""
    import torch
    from torch import nn

    from cluster.worker_heap import reuse_freed_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def train(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    train(20)
    with reuse_freed_memory() if raised else contextlib.nullcontext():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.thread_time()
        train(steps)
        cpu = time.thread_time() - cpu
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return 1000 * cpu / steps, faults / steps


def mnist_cnn() -> Any:
    """The tutorial's CNN as bench/harness_overhead.py builds it, same initial weights."""
    import torch
    from harness_overhead import make_model

    torch.manual_seed(0)
    return make_model("cnn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from distributed import Client

    from cluster.startup import embedded_cluster

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "worker": [], "worker_raised": []}
    with embedded_cluster(1, 1, port), Client(f"tcp://127.0.0.1:{port}") as client:
        for _ in range(args.repeats):  # interleaved: load changes hit all three alike
            rows["plain"].append(cnn_steps(mnist_cnn(), args.steps, raised=False))
            for name, raised in (("worker", False), ("worker_raised", True)):
                step = client.submit(cnn_steps, mnist_cnn(), args.steps, raised, pure=False)
                rows[name].append(step.result())
    medians = {
        name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        for name, runs in rows.items()
    }
    plain = medians["plain"][0]
    for name, (ms, faults) in medians.items():
        ratio = ms / plain
        print(f"{name:>14}: {ms:6.1f} ms CPU a step ({ratio:.2f}x plain), {faults:7.0f} faults")
    print(
        json.dumps(
            {
                "machine": f"{platform.node()} ({os.cpu_count()} CPUs), load {os.getloadavg()}",
                "runs": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
