"""What the registry costs the training loop, measured side by side against the real stack.

1. Logging overhead: the same harness run with metrics kept in memory vs sent to the
   local MLflow server (async, batched), at reporting periods of 100 batches and 1 batch.
   Beside wall time it prints this process's CPU per step (load on a shared machine does not
   inflate it) and the MLflow server's CPU per step during training.
2. Checkpoint upload: a ~500 MB state dict through our S3 checkpoint store vs a plain
   boto3 multipart upload of the same file to the same endpoint, and how long the
   training thread is blocked (serialising the state + returning from publish).

    python bench/registry_overhead.py   # starts the local stack if needed, stops it after
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness_overhead import BenchTrial, _Clock, cpu_name

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import PyTorchCallback
from det_tasks.pytorch.harness import CheckpointFiles, CheckpointWriter
from det_tasks.sinks import InMemoryMetricsSink
from infra.services import is_running
from infra.stack import StackConfig, down, mlflow_service, up


class ManyMetricsTrial(BenchTrial):
    """BenchTrial reporting ``metrics`` values per batch: loss and (metrics - 1) multiples."""

    metrics = 1

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        loss = super().train_batch(batch, epoch_idx, batch_idx)["loss"]
        value = loss.detach()
        return {"loss": loss, **{f"m{i:02d}": value * i for i in range(1, self.metrics)}}


class _CpuClock(_Clock):
    """Also stamps this process's CPU time (every thread: training and the sink's sender),
    which other jobs on a shared machine do not inflate the way they do wall time."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cpu: list[float] = []

    def on_training_workload_end(self, avg_metrics: Any, batch_metrics: Any) -> None:
        super().on_training_workload_end(avg_metrics, batch_metrics)
        self.cpu.append(time.process_time())


def server_processes() -> list[psutil.Process]:
    """The MLflow server's processes (the one on MLFLOW_TRACKING_URI's port, and its
    workers), to count the CPU it spends storing what the sink sends."""
    port = os.environ["MLFLOW_TRACKING_URI"].rstrip("/").rsplit(":", 1)[-1]
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "mlflow" in " ".join(argv) and "--port" in argv and port in argv:
            found.update((p.pid, p) for p in [proc, *proc.children(recursive=True)])
    return list(found.values())


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def timed_fit(
    steps: int, warmup: int, period: int, metrics: int, sink: object
) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per step after the warm-up."""
    clock = _CpuClock()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = pytorch.init(
            hparams={"model": "mlp", "records": 2048, "global_batch_size": 32},
            metrics_sink=sink,
            checkpoint_store=LocalDirectoryStore(tmp),
            seed=0,
        )
        trial = ManyMetricsTrial(ctx)
        trial.metrics = metrics
        clocked: dict[str, PyTorchCallback] = {"clock": clock}
        trial.build_callbacks = lambda: clocked  # type: ignore[method-assign]
        points = sorted({warmup, *range(warmup + period, warmup + steps + 1, period)})
        pytorch.Trainer(trial, ctx).fit(
            max_length=pytorch.Batch(warmup + steps),
            reporting_period=pytorch.Batch(points),
            checkpoint_policy="none",
        )
    wall = (clock.stamps[-1] - clock.stamps[0]) / steps
    return wall, (clock.cpu[-1] - clock.cpu[0]) / steps


CASES = [(100, 1), (1, 1), (1, 50)]  # (reporting period in batches, metrics per batch)
# Batches timed per case. 50 metrics a batch outpace the co-located server about sevenfold:
# at 2,000 batches (about 2 s) the sender has barely started when training ends, and the
# figure would miss its cost; 10,000 keep it sending, with a backlog, for the whole window.
CASE_STEPS = {(100, 1): 2000, (1, 1): 2000, (1, 50): 10000}


def logging_overhead(
    steps: int | None, repeats: int, cases: list[tuple[int, int]] = CASES
) -> dict[str, float]:
    """Step time with the MLflow sink over step time with an in-memory sink, interleaved.
    Each MLflow run is drained (sink.close) before the next run starts, so the server's
    backlog from one run never lands on the next. Beside wall time: this process's CPU per
    step (the sink's own cost, sender thread included) and the server's CPU per step
    during training (on a 2-core machine the server competes with training for the cores)."""
    from registry.metrics.sink import MlflowMetricsSink
    from registry.runs.tracking import ExperimentRuns, client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    runs = ExperimentRuns(client, "bench-logging", uuid.uuid4().hex, {"searcher": {}})
    server = server_processes()
    out: dict[str, float] = {}
    for period, metrics in cases:
        case_steps = steps or CASE_STEPS[(period, metrics)]
        base, logged, drains, base_cpu, logged_cpu, server_cpu = [], [], [], [], [], []
        for r in range(repeats):
            wall, cpu = timed_fit(case_steps, 100, period, metrics, InMemoryMetricsSink())
            base.append(wall)
            base_cpu.append(cpu)
            run_id = runs.trial_run(f"p{period}-m{metrics}-{r}", {}, {})
            sink = MlflowMetricsSink(client, run_id, spill_dir=Path(tempfile.mkdtemp()))
            served = cpu_seconds(server)
            wall, cpu = timed_fit(case_steps, 100, period, metrics, sink)
            server_cpu.append((cpu_seconds(server) - served) / (case_steps + 100))
            logged.append(wall)
            logged_cpu.append(cpu)
            t0 = time.perf_counter()
            sink.close()
            drains.append(time.perf_counter() - t0)
        case = f"period_{period}_metrics_{metrics}"
        out[f"{case}_batches_timed"] = case_steps
        out[f"{case}_ms_in_memory"] = 1000 * statistics.median(base)
        out[f"{case}_ms_mlflow"] = 1000 * statistics.median(logged)
        out[f"{case}_ratio"] = statistics.median(logged) / statistics.median(base)
        out[f"{case}_cpu_ms_in_memory"] = 1000 * statistics.median(base_cpu)
        out[f"{case}_cpu_ms_mlflow"] = 1000 * statistics.median(logged_cpu)
        out[f"{case}_cpu_ratio"] = statistics.median(logged_cpu) / statistics.median(base_cpu)
        out[f"{case}_server_cpu_ms_per_step"] = 1000 * statistics.median(server_cpu)
        out[f"{case}_drain_after_training_s"] = statistics.median(drains)
        out[f"{case}_load_average"] = os.getloadavg()[0]
    return out


def checkpoint_upload(megabytes: int) -> dict[str, float]:
    import boto3

    from registry.checkpoints.store import S3CheckpointStore
    from registry.runs.tracking import ExperimentRuns, client_for
    from registry.servers import s3 as s3_lib

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    runs = ExperimentRuns(client, "bench-checkpoints", uuid.uuid4().hex, {"searcher": {}})
    run_id = runs.trial_run("1", {}, {})
    n = megabytes * 2**20 // 4
    state = {"models_state_dict": [{"weight": torch.randn(n)}]}
    cache = Path(tempfile.mkdtemp())
    s3 = s3_lib.client()
    store = S3CheckpointStore(
        client,
        s3,
        run_id,
        artifacts_destination=os.environ["DET_TASKS_MLFLOW_ARTIFACTS"],
        cache_dir=cache,
    )
    t0 = time.perf_counter()
    host_copy = {k: [{n_: t.clone() for n_, t in sd.items()} for sd in v] for k, v in state.items()}
    host_copy_s = time.perf_counter() - t0
    del host_copy

    # The harness's own write path: the training thread returns after the host snapshot;
    # serialising, checksums and the upload run behind it.
    writer = CheckpointWriter(store, torch.device("cpu"))
    files = CheckpointFiles(load_data={}, model_dir=None, metadata={"steps_completed": 1})
    t0 = time.perf_counter()
    uid = writer.save(state, files, write_end=[], previous=None)
    blocked_s = time.perf_counter() - t0
    writer.finished(wait=True)
    written_s = time.perf_counter() - t0
    store.completed_uploads(wait=True)
    ours_s = time.perf_counter() - t0
    plain_file = cache / "plain.pth"
    torch.save(state, plain_file)

    bucket = os.environ["DET_TASKS_S3_BUCKET"]
    t0 = time.perf_counter()
    boto3.session.Session().client(
        "s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"]
    ).upload_file(str(plain_file), bucket, f"bench/{uuid.uuid4().hex}.pth", Config=s3_lib.TRANSFER)
    plain_s = time.perf_counter() - t0
    store.delete(uid)
    store.close()
    return {
        "megabytes": megabytes,
        "plain_boto3_s": plain_s,
        "ours_upload_s": ours_s - written_s,
        "throughput_vs_boto3": plain_s / (ours_s - written_s),
        "training_thread_blocked_s": blocked_s,
        "host_copy_of_state_s": host_copy_s,
        "written_in_background_after_s": written_s,
    }


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, 1 torch thread, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--steps", type=int, default=None, help="batches timed per case (default: CASE_STEPS)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint-mb", type=int, default=500)
    parser.add_argument("--only", choices=["logging", "checkpoint"])
    parser.add_argument(
        "--case",
        action="append",
        choices=[f"{p}x{m}" for p, m in CASES],
        help="logging cases to run, PERIODxMETRICS (default: all)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    started_stack: StackConfig | None = None
    if "MLFLOW_TRACKING_URI" not in os.environ:
        config = StackConfig.from_env()
        if not is_running(mlflow_service(config)):
            started_stack = config  # ours to stop after; a stack `make up` started is kept
        os.environ.update(up(config, prefect=False))
    try:
        result: dict[str, Any] = {"machine": machine()}
        if args.only in (None, "logging"):
            cases = [c for c in CASES if args.case is None or f"{c[0]}x{c[1]}" in args.case]
            result["logging"] = logging_overhead(args.steps, args.repeats, cases)
        if args.only in (None, "checkpoint"):
            result["checkpoint"] = checkpoint_upload(args.checkpoint_mb)
    finally:
        if started_stack is not None:
            down(started_stack)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
