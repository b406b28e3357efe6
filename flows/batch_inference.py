"""The ``batch-inference`` flow: a registered model over a dataset, in shards, predictions to S3.

The input is any torch Dataset built by ``module:function`` in the checkpoint's code (map-style
or iterable), or Parquet files on S3 (``s3://bucket/prefix/*.parquet`` with ``columns``). It is
checked once, before any shard starts (a bad spec or a missing column fails the run with
nothing written). Each shard task streams only its own records on a worker process: the warm
Dask workers when the engine is there (``cluster.startup``), else a pool of ``workers`` processes;
either way the model is loaded once per worker, not once per shard. Each shard writes one
Parquet object (``shard-00003-of-00008.parquet``: record id, output, argmax); a shard whose
object exists is skipped, so rerunning after a crash writes every shard exactly once. The
model comes from ``load_trial_from_checkpoint_path`` (``models:/name@alias`` is pinned to its
version at the start); ``trial.predict_batch(batch)`` is used when the trial defines it, else
the wrapped model's forward output.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from cluster.batch_data import shard_range
from cluster.batch_shards import ShardRequest, run_shard
from det_tasks.errors import ConfigError
from flows.jobs import run_job_script
from flows.log_delivery import logs_delivered
from registry.experiments.packages import fetch_package
from registry.jobs import parquet_dataset
from registry.runs.tracking import client_for
from registry.servers.settings import RegistrySettings

__all__ = ["batch_inference", "plan_shards", "predict_shard", "shard_range"]

# The flow run's engine (an Executor-like ``submit``); shard tasks reach it through this
# context variable (Prefect runs tasks in copies of the flow's context).
_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar("batch_engine", default=None)


def _pinned(model_uri: str) -> str:
    """``models:/name@alias`` -> the version's source, so every shard uses the same model."""
    if model_uri.startswith("models:/"):
        from registry.checkpoints.uris import models_uri_source

        return models_uri_source(model_uri)
    return model_uri


def plan_shards(
    model_source: str,
    dataset: str,
    num_shards: int,
    output: str,
    batch_size: int,
    columns: Sequence[str] | None = None,
    id_column: str | None = None,
) -> list[ShardRequest]:
    """One request per shard; checks the dataset spec (and Parquet columns) first."""
    if num_shards < 1 or batch_size < 1:
        raise ConfigError(
            f"num_shards ({num_shards}) and batch_size ({batch_size}) must be positive integers"
        )
    common = dict(
        model_source=model_source,
        dataset=dataset,
        num_shards=num_shards,
        output=output,
        batch_size=batch_size,
    )
    if dataset.startswith("s3://"):
        spec = parquet_dataset.ParquetSpec.parse(dataset, columns, id_column)
        groups = parquet_dataset.plan(spec)
        return [
            ShardRequest(
                shard=i,
                columns=spec.columns,
                id_column=spec.id_column,
                row_groups=tuple(parquet_dataset.shard_row_groups(groups, i, num_shards)),
                **common,  # type: ignore[arg-type]
            )
            for i in range(num_shards)
        ]
    if columns or id_column:
        raise ConfigError(
            f"dataset {dataset!r}: `columns`/`id_column` apply to Parquet datasets "
            "(s3://bucket/prefix/*.parquet) only; remove them"
        )
    from cluster.batch_shards import shard_dataset

    shard_dataset(model_source, dataset)  # builds it once here: a bad spec fails before any shard
    return [ShardRequest(shard=i, **common) for i in range(num_shards)]  # type: ignore[arg-type]


@contextlib.contextmanager
def _engine(workers: int) -> Iterator[Any]:
    """The warm Dask workers when the engine exists, else ``workers`` worker processes."""
    engine: Any = None
    try:
        from cluster.startup import dask_client

        engine = dask_client
    except ImportError:
        pass
    if engine is not None:
        with engine(n_workers=workers) as client:
            yield client
        return
    context = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        yield pool


@task(name="predict-shard", retries=2, retry_delay_seconds=1)
def predict_shard(request: ShardRequest) -> dict[str, Any]:
    """Run one shard on the flow's engine (in this process when there is none)."""
    engine = _ENGINE.get()
    if engine is None:
        return run_shard(request)
    if hasattr(engine, "scheduler_info"):  # a Dask client: never reuse a result by key
        return engine.submit(run_shard, request, pure=False).result()  # type: ignore[no-any-return]
    return engine.submit(run_shard, request).result()  # type: ignore[no-any-return]


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
    columns: list[str] | None = None,
    id_column: str | None = None,
    workers: int = 2,
) -> dict[str, Any]:
    """Predictions of ``model_uri`` over ``dataset`` in ``num_shards`` Parquet objects; or,
    with ``script`` (from ``det-tasks job run``), that script run inside ``package``."""
    with logs_delivered():  # every shard's line is on the server before Completed
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
        requests = plan_shards(
            _pinned(model_uri), dataset, num_shards, output, batch_size, columns, id_column
        )
        with _engine(max(1, min(workers, num_shards))) as engine:
            token = _ENGINE.set(engine)
            try:
                futures = [predict_shard.submit(r) for r in requests]
                results = [f.result() for f in futures]
            finally:
                _ENGINE.reset(token)
        wall = time.perf_counter() - started
        rows = sum(r["rows"] for r in results)
        summary = {
            "output": output,
            "shards": num_shards,
            "shards_skipped": sum(r["skipped"] for r in results),
            "rows": rows,
            "seconds": round(wall, 2),
            "rows_per_second": round(rows / wall, 1) if wall else 0,
            "peak_rss_mb": max((r.get("peak_rss_mb", 0.0) for r in results), default=0.0),
            "shard_seconds": round(sum(r["seconds"] for r in results), 3),
            "stream_seconds": round(sum(r.get("stream_seconds", 0.0) for r in results), 3),
            "stream_cpu_seconds": round(sum(r.get("stream_cpu_seconds", 0.0) for r in results), 3),
        }
        if settings.tracking_uri:
            _log_run(settings.tracking_uri, f"{safe_model}-{name}", model_uri, output, summary)
        logger.info("batch inference: %s", summary)
        return summary


def _log_run(
    tracking_uri: str, run_name: str, model_uri: str, output: str, summary: dict[str, Any]
) -> None:
    client = client_for(tracking_uri)
    exp = client.get_experiment_by_name("batch-inference")
    exp_id = exp.experiment_id if exp else client.create_experiment("batch-inference")
    run = client.create_run(
        exp_id, run_name=run_name, tags={"det.model_uri": model_uri, "det.output": output}
    )
    for key in ("rows", "shards_skipped", "seconds", "rows_per_second", "peak_rss_mb"):
        client.log_metric(run.info.run_id, key, float(summary[key]))
    client.set_terminated(run.info.run_id)


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
