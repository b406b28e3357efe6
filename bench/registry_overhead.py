"""What the registry costs the training loop, measured side by side against the real stack.

1. Logging overhead: the same harness run with metrics kept in memory vs sent to the
   local MLflow server (async, batched), at reporting periods of 100 batches and 1 batch.
2. Checkpoint upload: a ~500 MB state dict through our S3 checkpoint store vs a plain
   boto3 multipart upload of the same file to the same endpoint, and how long the
   training thread is blocked (serialising the state + returning from publish).

    python bench/registry_overhead.py   # starts the local stack if needed, stops it after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness_overhead import BenchTrial, _Clock, cpu_name

from det_tasks import pytorch
from det_tasks.pytorch._checkpointing import CheckpointFiles, CheckpointWriter
from det_tasks.sinks import InMemoryMetricsSink
from det_tasks.storage import LocalDirectoryStore
from infra.services import is_running
from infra.stack import StackConfig, down, mlflow_service, up


class ManyMetricsTrial(BenchTrial):
    """BenchTrial reporting ``metrics`` values per batch: loss and (metrics - 1) multiples."""

    metrics = 1

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        loss = super().train_batch(batch, epoch_idx, batch_idx)["loss"]
        value = loss.detach()
        return {"loss": loss, **{f"m{i:02d}": value * i for i in range(1, self.metrics)}}


def timed_fit(steps: int, warmup: int, period: int, metrics: int, sink: object) -> float:
    clock = _Clock(torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = pytorch.init(
            hparams={"model": "mlp", "records": 2048, "global_batch_size": 32},
            metrics_sink=sink,
            checkpoint_store=LocalDirectoryStore(tmp),
            seed=0,
        )
        trial = ManyMetricsTrial(ctx)
        trial.metrics = metrics
        clocked = {"clock": clock}
        trial.build_callbacks = lambda: clocked  # type: ignore[method-assign]
        points = sorted({warmup, *range(warmup + period, warmup + steps + 1, period)})
        pytorch.Trainer(trial, ctx).fit(
            max_length=pytorch.Batch(warmup + steps),
            reporting_period=pytorch.Batch(points),
            checkpoint_policy="none",
        )
    return (clock.stamps[-1] - clock.stamps[0]) / steps


CASES = [(100, 1), (1, 1), (1, 50)]  # (reporting period in batches, metrics per batch)


def logging_overhead(steps: int, repeats: int) -> dict[str, float]:
    """Step time with the MLflow sink over step time with an in-memory sink, interleaved.
    Each MLflow run is drained (sink.close) before the next run starts, so the server's
    backlog from one run never lands on the next."""
    from registry.metrics import MlflowMetricsSink
    from registry.tracking import ExperimentRuns, client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    runs = ExperimentRuns(client, "bench-logging", uuid.uuid4().hex, {"searcher": {}})
    out: dict[str, float] = {}
    for period, metrics in CASES:
        base, logged, drains = [], [], []
        for r in range(repeats):
            base.append(timed_fit(steps, 100, period, metrics, InMemoryMetricsSink()))
            run_id = runs.trial_run(f"p{period}-m{metrics}-{r}", {}, {})
            sink = MlflowMetricsSink(client, run_id, spill_dir=Path(tempfile.mkdtemp()))
            logged.append(timed_fit(steps, 100, period, metrics, sink))
            t0 = time.perf_counter()
            sink.close()
            drains.append(time.perf_counter() - t0)
        case = f"period_{period}_metrics_{metrics}"
        out[f"{case}_ms_in_memory"] = 1000 * statistics.median(base)
        out[f"{case}_ms_mlflow"] = 1000 * statistics.median(logged)
        out[f"{case}_ratio"] = statistics.median(logged) / statistics.median(base)
        out[f"{case}_drain_after_training_s"] = statistics.median(drains)
    return out


def checkpoint_upload(megabytes: int) -> dict[str, float]:
    import boto3

    from registry import s3 as s3_lib
    from registry.checkpoints import S3CheckpointStore
    from registry.tracking import ExperimentRuns, client_for

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
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint-mb", type=int, default=500)
    parser.add_argument("--only", choices=["logging", "checkpoint"])
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
            result["logging"] = logging_overhead(args.steps, args.repeats)
        if args.only in (None, "checkpoint"):
            result["checkpoint"] = checkpoint_upload(args.checkpoint_mb)
    finally:
        if started_stack is not None:
            down(started_stack)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
