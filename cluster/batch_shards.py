"""One shard of batch inference, run on a worker process: stream its records through the
model and write one Parquet object of predictions with their record ids.

Worker-side and Prefect-free, so it runs in any worker process (a process pool, or a warm
Dask worker). The model and the dataset are loaded once per worker process (``_model``,
``shard_dataset``: a worker keeps them between shards), never once per shard. The predictions
are spilled to a local Parquet file while the shard runs and stored with a single put at
the end: the object exists complete or not at all, so a retried shard is written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from cluster.batch_data import load_dataset, model_input, shard_batches
from cluster.worker_heap import reuse_freed_memory
from det_tasks.checkpoints.format import verify
from det_tasks.checkpoints.references import open_checkpoint_uri
from det_tasks.pytorch import load_trial_from_checkpoint_path, to_device
from det_tasks.pytorch.harness import check_code_trusted
from registry.jobs import parquet_dataset
from registry.servers import s3 as s3_lib
from registry.servers.local_files import FileLocation

__all__ = ["ShardRequest", "run_shard", "shard_dataset", "shard_name"]


@dataclasses.dataclass(frozen=True)
class ShardRequest:
    model_source: str  # a pinned checkpoint URI (models:/ aliases resolved by the flow)
    dataset: str  # `module:function` or `s3://bucket/prefix/*.parquet`
    shard: int
    num_shards: int
    output: str  # the run's output prefix
    batch_size: int
    columns: tuple[str, ...] = ()
    id_column: str | None = None
    row_groups: tuple[parquet_dataset.RowGroup, ...] = ()


def shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.parquet"


@functools.lru_cache(maxsize=2)
def _code_dir(source: str) -> Path | None:
    """The checkpoint's ``code/`` directory (where dataset functions live), once per process;
    importing from it runs its code, so the checkpoint must pass the same trust check as
    ``load_trial_from_checkpoint_path`` (signed here, or from the registry)."""
    stack = contextlib.ExitStack()  # kept open for the process's life (a cached download)
    directory = stack.enter_context(open_checkpoint_uri(source))
    check_code_trusted(source, directory, verify(directory), trust_code=False)
    code = directory / "code"
    return code if code.is_dir() else None


@functools.lru_cache(maxsize=2)
def _model(source: str) -> Any:
    """The trial, loaded once per worker process and kept between shards."""
    trial = load_trial_from_checkpoint_path(source)
    if isinstance(trial, torch.nn.Module):  # a build_model() trial loads as its model
        return trial.eval()
    for model in trial.context.models:
        model.eval()
    return trial


@functools.lru_cache(maxsize=2)
def shard_dataset(source: str, spec: str) -> torch.utils.data.Dataset:
    """The dataset ``spec`` names, with the checkpoint's code on the path; built once per
    process and kept between shards (the flow builds it first, so a bad spec fails before
    any shard runs)."""
    return load_dataset(spec, _code_dir(source))


def _batches(req: ShardRequest) -> Iterator[tuple[np.ndarray, Any]]:
    if req.dataset.startswith("s3://"):
        spec = parquet_dataset.ParquetSpec(req.dataset, req.columns, req.id_column)
        for ids, features in parquet_dataset.iter_batches(
            spec, list(req.row_groups), req.batch_size
        ):
            yield ids, torch.from_numpy(features)
        return
    yield from shard_batches(
        shard_dataset(req.model_source, req.dataset), req.shard, req.num_shards, req.batch_size
    )


def _release_held_trial() -> None:
    """On a warm Dask worker that holds a training trial, free its memory first."""
    with contextlib.suppress(Exception):
        from distributed import get_worker

        from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin

        plugin = get_worker().plugins.get(PLUGIN_NAME)
        if isinstance(plugin, HeldTrialPlugin):
            plugin.release()  # a no-op when it holds nothing


class _Spill:
    """Predictions buffered in memory up to ``limit`` rows, then appended to a local Parquet
    file as one row group: few, large writes, and memory bounded whatever the shard's size.
    The outputs are copied into one block allocated once, not kept as a small array a batch:
    those, left between each batch's freed temporaries, fragmented the worker's heap (+120 MB
    at 250,000 records a shard, once the worker reuses freed memory; cluster.worker_heap)."""

    def __init__(self, path: Path, limit: int = 65_536) -> None:
        self.path = path
        self.limit = limit
        self.ids: list[np.ndarray] = []
        self.block: np.ndarray | None = None  # (rows, width): the buffered outputs
        self.buffered = 0
        self.rows = 0
        self.writer: pq.ParquetWriter | None = None

    def add(self, ids: np.ndarray, outputs: np.ndarray) -> None:
        n = len(ids)
        if self.block is None or self.buffered + n > len(self.block):
            self.flush()
            if self.block is None or n > len(self.block):
                self.block = np.empty((max(self.limit, n), *outputs.shape[1:]), outputs.dtype)
        self.block[self.buffered : self.buffered + n] = outputs
        self.ids.append(np.asarray(ids))
        self.buffered += n
        self.rows += n

    def flush(self) -> None:
        if not self.buffered or self.block is None:
            return
        outputs = self.block[: self.buffered]
        table = pa.table(
            {
                "index": pa.array(np.concatenate(self.ids)),
                "output": pa.FixedSizeListArray.from_arrays(
                    pa.array(outputs.ravel()), outputs.shape[1]
                ),
                "argmax": pa.array(outputs.argmax(axis=1)),
            }
        )
        # Dictionary-encoding only the class column: pyarrow tries a dictionary for every
        # column by default, and for unique ids and float outputs that is wasted work (33 ms
        # instead of 5.5 ms a 25,000-row group, and a file 1.5x the size); same values read.
        self.writer = self.writer or pq.ParquetWriter(
            self.path, table.schema, use_dictionary=["argmax"]
        )
        self.writer.write_table(table)
        self.ids, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        if self.writer is None:  # an empty shard still gets its (empty) object
            pq.write_table(_empty_table(), self.path)
        else:
            self.writer.close()


def _predictor(loaded: Any) -> tuple[Any, torch.device]:
    """What predicts a batch, and its device: the trial's predict_batch or first model, or
    the bare model a build_model() trial loads as (as Determined loads it)."""
    if isinstance(loaded, torch.nn.Module):
        first = next(loaded.parameters(), None)
        return loaded, first.device if first is not None else torch.device("cpu")
    predict = getattr(loaded, "predict_batch", None) or loaded.context.models[0]
    return predict, loaded.context.device


def run_shard(req: ShardRequest) -> dict[str, Any]:
    """Predict one shard; skipped (``skipped: True``) when its object already exists."""
    started = time.perf_counter()
    location = s3_lib.parse_location(req.output).child(shard_name(req.shard, req.num_shards))
    # A local output needs no client (building one takes ~0.1 s of botocore's JSON).
    s3 = None if isinstance(location, FileLocation) else s3_lib.client()
    if s3_lib.object_exists(s3, location):
        return {"shard": req.shard, "skipped": True, "rows": 0, "seconds": 0.0}
    _release_held_trial()
    trial = _model(req.model_source)
    predict, device = _predictor(trial)
    on_cpu = device.type == "cpu"
    scratch = Path(tempfile.mkdtemp(prefix="det-tasks-shard-"))
    try:
        spill = _Spill(scratch / "part.parquet")
        batches = _batches(req)
        streaming = time.perf_counter()  # the model is loaded: the loop alone from here
        streaming_cpu = time.thread_time()  # this thread's CPU: what a busy host leaves alone
        with reuse_freed_memory(), torch.inference_mode():
            for ids, batch in batches:
                inputs = model_input(batch)
                out = predict(inputs if on_cpu else to_device(inputs, device))
                spill.add(ids, out.detach().float().cpu().reshape(len(ids), -1).numpy())
            spill.close()
        stream_seconds = time.perf_counter() - streaming
        stream_cpu_seconds = time.thread_time() - streaming_cpu
        s3_lib.upload_file(s3, spill.path, location)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "shard": req.shard,
        "skipped": False,
        "rows": spill.rows,
        "seconds": time.perf_counter() - started,
        "stream_seconds": stream_seconds,
        "stream_cpu_seconds": stream_cpu_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _empty_table() -> pa.Table:
    return pa.table(
        {
            "index": pa.array([], pa.int64()),
            "output": pa.array([], pa.list_(pa.float32())),
            "argmax": pa.array([], pa.int64()),
        }
    )
