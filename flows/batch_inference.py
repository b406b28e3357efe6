"""The ``batch-inference`` flow: a registered model over a dataset, in shards, predictions to S3.

Each shard is a task that writes one Parquet object (``shard-00003-of-00008.parquet``); a
shard whose object already exists is skipped, so rerunning after a crash writes every shard
exactly once. The trial comes from ``load_trial_from_checkpoint_path`` (``models:/name@alias``
by default); ``trial.predict_batch(batch)`` is used when the trial defines it, else the
wrapped model's forward output.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from det_tasks.pytorch import load_trial_from_checkpoint_path
from det_tasks.uris import open_checkpoint_uri
from flows.jobs import run_job_script
from registry import s3 as s3_lib
from registry.packages import fetch_package
from registry.settings import RegistrySettings
from registry.tracking import client_for

__all__ = ["batch_inference", "load_inputs", "shard_range"]


def shard_range(n: int, shard: int, num_shards: int) -> range:
    """Contiguous, disjoint, covering: shard i of k gets records [i*n//k, (i+1)*n//k)."""
    return range(shard * n // num_shards, (shard + 1) * n // num_shards)


@contextlib.contextmanager
def _code_on_path(model_uri: str) -> Iterator[None]:
    with open_checkpoint_uri(model_uri) as directory:
        code = str(Path(directory) / "code")
        sys.path.insert(0, code)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(code)


def load_inputs(model_uri: str, dataset: str) -> torch.Tensor:
    """``module:function`` from the checkpoint's code; the first tensor it returns is the input."""
    module_name, _, function = dataset.partition(":")
    if not function:
        raise ValueError(f"dataset {dataset!r} must be `module:function`")
    with _code_on_path(model_uri):
        sys.modules.pop(module_name, None)
        loaded = getattr(importlib.import_module(module_name), function)()
    if isinstance(loaded, list | tuple):
        loaded = loaded[0]
    if isinstance(loaded, torch.utils.data.TensorDataset):
        loaded = loaded.tensors[0]
    if not isinstance(loaded, torch.Tensor):
        raise TypeError(f"dataset {dataset!r} returned {type(loaded).__name__}, not tensors")
    return loaded


@task(name="predict-shard", retries=2, retry_delay_seconds=1)
def predict_shard(
    model_uri: str, dataset: str, shard: int, num_shards: int, output: str, batch_size: int
) -> dict[str, Any]:
    s3 = s3_lib.client()
    location = s3_lib.parse_location(output).child(f"shard-{shard:05d}-of-{num_shards:05d}.parquet")
    if s3_lib.object_exists(s3, location):
        return {"shard": shard, "skipped": True, "rows": 0, "seconds": 0.0}
    started = time.perf_counter()
    trial = load_trial_from_checkpoint_path(model_uri)
    inputs = load_inputs(model_uri, dataset)
    rows = shard_range(len(inputs), shard, num_shards)
    model = trial.context.models[0]
    predict = getattr(trial, "predict_batch", None)
    outputs = []
    with torch.inference_mode():
        for start in range(rows.start, rows.stop, batch_size):
            batch = trial.context.to_device(inputs[start : min(start + batch_size, rows.stop)])
            out = predict(batch) if predict is not None else model(batch)
            outputs.append(out.detach().float().cpu())
    preds = torch.cat(outputs) if outputs else torch.empty(0)
    table = pa.table(
        {
            "index": pa.array(list(rows), pa.int64()),
            "output": pa.array(preds.reshape(len(rows), -1).tolist(), pa.list_(pa.float32())),
            "argmax": pa.array(preds.reshape(len(rows), -1).argmax(dim=1).tolist(), pa.int64()),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    s3_lib.put_object(s3, location, buffer.getvalue())
    return {
        "shard": shard,
        "skipped": False,
        "rows": len(rows),
        "seconds": time.perf_counter() - started,
    }


@flow(name="batch-inference", log_prints=True)
def batch_inference(
    model_uri: str = "models:/mnist@champion",
    dataset: str = "data:load_digits_28",
    num_shards: int = 4,
    output: str | None = None,
    batch_size: int = 256,
    run_name: str | None = None,
    package: str | None = None,
    script: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Predictions of ``model_uri`` over ``dataset`` in ``num_shards`` Parquet objects; or,
    with ``script`` (from ``det-tasks job run``), that script run inside ``package``."""
    logger = get_run_logger()
    settings = RegistrySettings.from_env()
    if script:
        if not package:
            raise ValueError("script= needs package= (the model directory it lives in)")
        return _run_script_job(package, script, config or {}, output, settings)
    name = run_name or time.strftime("%Y-%m-%d")
    safe_model = model_uri.replace("models:/", "").replace("/", "-").replace("@", "-at-")
    output = output or f"s3://{settings.bucket or 'det-tasks'}/predictions/{safe_model}/{name}"
    started = time.perf_counter()
    futures = [
        predict_shard.submit(model_uri, dataset, shard, num_shards, output, batch_size)
        for shard in range(num_shards)
    ]
    results = [f.result() for f in futures]
    wall = time.perf_counter() - started
    rows = sum(r["rows"] for r in results)
    skipped = sum(r["skipped"] for r in results)
    summary = {
        "output": output,
        "shards": num_shards,
        "shards_skipped": skipped,
        "rows": rows,
        "seconds": round(wall, 2),
        "rows_per_second": round(rows / wall, 1) if wall else 0,
    }
    if settings.tracking_uri:
        client = client_for(settings.tracking_uri)
        exp = client.get_experiment_by_name("batch-inference")
        exp_id = exp.experiment_id if exp else client.create_experiment("batch-inference")
        run = client.create_run(
            exp_id,
            run_name=f"{safe_model}-{name}",
            tags={"det.model_uri": model_uri, "det.output": output},
        )
        for key in ("rows", "shards_skipped", "seconds", "rows_per_second"):
            client.log_metric(run.info.run_id, key, float(summary[key]))
        client.set_terminated(run.info.run_id)
    logger.info("batch inference: %s", summary)
    return summary


def _run_script_job(
    package: str,
    script: str,
    config: dict[str, Any],
    output: str | None,
    settings: RegistrySettings,
) -> dict[str, Any]:
    job_id = str(flow_run.get_id() or time.strftime("%Y%m%d-%H%M%S"))
    output = output or f"s3://{settings.bucket or 'det-tasks'}/jobs/{job_id}"
    model_dir = fetch_package(package)
    try:
        # A failed attempt (a killed rank) is retried; torch_batch_process resumes from the
        # job's progress checkpoints, so finished batches are not processed again.
        attempt = run_job_script.with_options(retries=int(config.get("max_restarts") or 0))
        result = attempt(str(model_dir), script, config, job_id, output)
    finally:
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    get_run_logger().info("job %s wrote %d files under %s", job_id, len(result["files"]), output)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    print(batch_inference(sys.argv[1]) if len(sys.argv) > 1 else batch_inference())
