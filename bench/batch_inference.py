"""Batch inference throughput: the ``batch-inference`` flow against a plain PyTorch loop over
the same model (an MLP 784-256-10 loaded from the same checkpoint), the same dataset (map-style,
``bench/batch_model``) and the same device (CPU), side by side in one run, interleaved.

- plain: ``DataLoader(dataset, batch_size)`` -> ``model(x)`` -> outputs to numpy, one process.
- flow, 1 and 2 workers: ``batch_inference(...)`` (2 shards per worker) to a local output
  directory; the shards run on the flow's engine (the warm Dask workers of cluster/).
  Two rates each: steady (records / the shards' streaming time once the model is loaded,
  per worker; also per CPU second of the streaming threads, which a busy shared host
  disturbs far less than wall time) and end to end (records / the flow call's wall time:
  cluster start, model load once per worker, Prefect's task bookkeeping, writing the
  Parquet objects).
- peak memory: the worker process's peak RSS for N and 10 N records (one worker).

Every process gets one thread (OMP_NUM_THREADS=1). The figures are medians of the repeats.

    python bench/batch_inference.py [--records 50000] [--batch-size 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
for name in ("MLFLOW_TRACKING_URI", "DET_TASKS_DASK_SCHEDULER"):
    os.environ.pop(name, None)  # no servers: outputs go to a local directory

ROOT = Path(__file__).resolve().parent
MODEL = ROOT / "batch_model"
sys.path.insert(0, str(ROOT.parent))


def checkpoint(tmp: Path) -> str:
    from det_tasks.runner.in_process import run_trial

    result = run_trial(MODEL / "const.yaml", checkpoint_dir=tmp / "ckpt", progress=False)
    assert result.checkpoint_uri is not None
    return result.checkpoint_uri


def plain(source: str, records: int, batch_size: int) -> dict[str, float]:
    """Records/s of the plain loop (model loaded the same way, timing the loop only), per
    wall second and per CPU second of its thread."""
    import torch

    from det_tasks.pytorch import load_trial_from_checkpoint_path

    sys.path.insert(0, str(MODEL))
    try:
        import model_def  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(MODEL))
    torch.set_num_threads(1)
    model = load_trial_from_checkpoint_path(source).context.models[0].eval()
    loader = torch.utils.data.DataLoader(model_def.Records(records), batch_size=batch_size)
    started, started_cpu = time.perf_counter(), time.thread_time()
    outputs = []
    with torch.inference_mode():
        for x in loader:
            outputs.append(model(x).float().cpu().numpy())
    cpu = time.thread_time() - started_cpu
    return {"steady": records / (time.perf_counter() - started), "cpu": records / cpu}


def flow(source: str, records: int, batch_size: int, workers: int, out: Path) -> dict[str, float]:
    from flows.batch_inference import batch_inference

    started = time.perf_counter()
    summary = batch_inference(
        source,
        f"model_def:records_{records}",
        num_shards=2 * workers,
        output=out.as_uri(),
        batch_size=batch_size,
        workers=workers,
    )
    wall = time.perf_counter() - started
    assert summary["rows"] == records, summary
    stream_seconds = summary["stream_seconds"] / workers  # shards run `workers` at a time
    return {
        "steady": records / stream_seconds,
        "cpu": records / (summary["stream_cpu_seconds"] / workers),
        "end_to_end": records / wall,
        "peak_rss_mb": summary["peak_rss_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = checkpoint(tmp)
        flow(source, 1000, args.batch_size, 1, tmp / "warmup")  # Prefect's ephemeral server
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "flow x1": [], "flow x2": []}
        for r in range(args.repeats):
            runs["plain"].append(plain(source, args.records, args.batch_size))
            for workers in (1, 2):
                out = tmp / f"out-{r}-{workers}"
                runs[f"flow x{workers}"].append(
                    flow(source, args.records, args.batch_size, workers, out)
                )
        memory = {
            n: flow(source, n, args.batch_size, 1, tmp / f"mem-{n}")["peak_rss_mb"]
            for n in (args.records, 10 * args.records)
        }
    med = {k: {m: statistics.median(v[m] for v in vs) for m in vs[0]} for k, vs in runs.items()}
    base = med["plain"]["steady"]
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (shared with other work)"
    )
    print(
        f"{args.records} records, batch {args.batch_size}, CPU, 1 thread per process, "
        f"median of {args.repeats} interleaved repeats"
    )
    base_cpu = med["plain"]["cpu"]
    print(
        "| run | steady records/s | vs plain | per CPU second | vs plain | "
        "end-to-end records/s | vs plain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, m in med.items():
        e2e = m.get("end_to_end", m["steady"])
        print(
            f"| {name} | {m['steady']:.0f} | {m['steady'] / base:.2f}x | {m['cpu']:.0f} | "
            f"{m['cpu'] / base_cpu:.2f}x | {e2e:.0f} | {e2e / base:.2f}x |"
        )
    for name, vs in runs.items():
        each = ", ".join(f"{v['steady']:.0f} ({v['cpu']:.0f} per CPU s)" for v in vs)
        print(f"{name} steady, each repeat: {each}")
    print(
        f"2 workers / 1 worker (steady): {med['flow x2']['steady'] / med['flow x1']['steady']:.2f}x"
    )
    small, large = memory[args.records], memory[10 * args.records]
    print(
        f"peak RSS of a worker: {small:.0f} MB at {args.records} records, {large:.0f} MB at "
        f"{10 * args.records} ({large / small:.2f}x)"
    )


if __name__ == "__main__":
    main()
