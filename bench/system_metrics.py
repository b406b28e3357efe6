"""What sampling system metrics costs a training step, side by side: the same CPU training
loop with no sampler and with the trial runs' sampler (registry.metrics.system_metrics) at several
intervals, against a real MLflow server (SQLite, loopback), repeats interleaved.

    python bench/system_metrics.py [--repeats 5] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mlflow_server import mlflow_server
from registry.metrics.system_metrics import start_system_metrics
from registry.servers.settings import RegistrySettings

INTERVALS = (0.0, 10.0, 2.0, 1.0, 0.5)


def step_times(seconds: float) -> list[float]:
    """Seconds per step of a small MLP trained on random data for ``seconds``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def one(uri: str, interval: float, seconds: float) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bench") or client.get_experiment(
        client.create_experiment("bench")
    )
    run = client.create_run(exp.experiment_id)
    settings = RegistrySettings(
        tracking_uri=uri,
        s3_endpoint=None,
        bucket=None,
        artifacts_destination=None,
        cache_dir=Path(tempfile.gettempdir()),
        system_metrics_interval=interval,
    )
    sampler = start_system_metrics(settings, run.info.run_id)
    times = step_times(seconds)
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.finish()
    finish_s = time.perf_counter() - t0
    client.set_terminated(run.info.run_id)
    points = len(client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage"))
    # The mean, not the median: the sampler's cost lands on the few steps it interrupts.
    return {"step_ms": statistics.fmean(times) * 1000, "finish_s": finish_s, "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    with tempfile.TemporaryDirectory() as tmp:
        proc, uri = mlflow_server(Path(tmp), "--workers", "1")
        try:
            results: dict[float, list[dict[str, float]]] = {i: [] for i in INTERVALS}
            for _ in range(args.repeats):  # interleaved: load changes hit all alike
                for interval in INTERVALS:
                    results[interval].append(one(uri, interval, args.seconds))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    base = statistics.median(r["step_ms"] for r in results[0.0])
    report: dict[str, Any] = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), load {os.getloadavg()}",
        "run_seconds": args.seconds,
        "no_sampler_step_ms": round(base, 3),
    }
    for interval in INTERVALS[1:]:
        step = statistics.median(r["step_ms"] for r in results[interval])
        report[f"every_{interval:g}s"] = {
            "step_ms": round(step, 3),
            "step_ratio_vs_none": round(step / base, 3),
            "system_points_per_run": statistics.median(r["points"] for r in results[interval]),
            "finish_s": round(statistics.median(r["finish_s"] for r in results[interval]), 3),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
