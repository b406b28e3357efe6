"""``torch_batch_process``: Determined 0.38's batch-inference loop, unchanged semantics.

The dataset is cut into batches, and the batches are dealt round-robin to the ranks
(Determined's ``DistributedBatchSampler``: every record once). Every ``checkpoint_interval``
batches the processor's ``on_checkpoint_start`` runs, then the chief records the smallest
number of batches every rank has finished as a progress checkpoint; a restarted job skips
those batches. Unlike Determined it also runs off-cluster (progress and uploads then go to
``$DET_TASKS_HOME/jobs/<job id>``; set ``DET_TASKS_JOB_ID`` to resume a killed local job).
"""

from __future__ import annotations

import abc
import collections.abc
import json
import logging
import math
import uuid as uuid_lib
import warnings
from typing import Any

import torch.utils.data

from det_tasks import cluster_info
from det_tasks.checkpoints.format import METADATA_FILE
from det_tasks.distributed import DistributedContext
from det_tasks.pytorch._data.loader import DataLoader
from det_tasks.pytorch.experimental._batch_context import TorchBatchProcessorContext
from det_tasks.pytorch.experimental._job_services import (
    BatchJobServices,
    default_job_id,
    job_services,
)

__all__ = ["TorchBatchProcessor", "torch_batch_process"]

log = logging.getLogger("determined.pytorch")

DEFAULT_BATCH_SIZE = 1
PROGRESS_FILE = "batch_completed.json"


class TorchBatchProcessor(metaclass=abc.ABCMeta):
    """Subclass it: build the model in ``__init__``, handle one batch in ``process_batch``."""

    @abc.abstractmethod
    def __init__(self, context: TorchBatchProcessorContext) -> None:
        """Load the model (``context.prepare_model_for_inference``) and other resources."""

    @abc.abstractmethod
    def process_batch(self, batch: Any, batch_idx: int) -> None:
        """Handle one batch; ``batch_idx`` counts this rank's batches from 0."""

    def on_checkpoint_start(self) -> None:  # noqa: B027
        """Runs right before each progress checkpoint: write what you buffered."""

    def on_finish(self) -> None:  # noqa: B027
        """Runs once after the last batch."""


def _validate_dataloader_kwargs(kwargs: dict[str, Any], batch_size: int | None) -> None:
    if kwargs.get("shuffle"):
        raise ValueError(
            "torch_batch_process: dataloader_kwargs shuffle=True is not allowed: the records "
            "must keep their order for sharding and resuming; remove it"
        )
    for key in ("sampler", "batch_sampler"):
        if key in kwargs:
            raise ValueError(
                f"torch_batch_process: remove {key!r} from dataloader_kwargs; the batches are "
                "sampled and sharded across ranks automatically"
            )
    if batch_size is not None and "batch_size" in kwargs:
        raise ValueError(
            "torch_batch_process: batch_size is given both as an argument and in "
            "dataloader_kwargs; give it once"
        )


def _iterate_length(max_batches: int | None, per_rank_batches: int) -> int:
    if max_batches is None:
        return per_rank_batches
    if max_batches <= 0 or max_batches > per_rank_batches:
        why = "is not positive" if max_batches <= 0 else "exceeds this rank's batch count"
        warnings.warn(
            f"max_batches={max_batches} {why} ({per_rank_batches}); processing the whole "
            "dataset once",
            stacklevel=3,
        )
        return per_rank_batches
    return max_batches


def _distributed(given: DistributedContext | None) -> DistributedContext:
    if given is not None:
        return given
    from det_tasks.pytorch._trainer import detect_distributed

    info = cluster_info.get_cluster_info()
    return detect_distributed((info.trial.config.get("optimizations") or {}) if info else {})


class _Progress:
    """The chief's progress checkpoints: record, find the newest, read one back."""

    def __init__(self, services: BatchJobServices, dist: DistributedContext) -> None:
        self.services = services
        self.dist = dist
        self.previous: str | None = None

    def restore(self, latest: str | None) -> tuple[int, str | None]:
        if latest is None:
            return 0, None
        with self.services.checkpoint_store.restore(latest) as path:
            meta = json.loads((path / METADATA_FILE).read_text(encoding="utf-8"))
        self.previous = latest
        return int(meta["steps_completed"]), meta["default_output_uuid"]

    def save(self, steps_completed: int, output_uuid: str) -> None:
        """Gather every rank's count; the chief checkpoints the minimum. No rank moves on
        before it is stored, so a rank killed right after still finds its batches counted."""
        counts = self.dist.gather(steps_completed)
        if counts is not None:
            self._store(min(counts), output_uuid)
        self.dist.broadcast(None)

    def _store(self, done: int, output_uuid: str) -> None:
        store = self.services.checkpoint_store
        staged = store.stage()
        (staged / PROGRESS_FILE).write_text(json.dumps({"batch_completed": done}))
        uuid = store.publish(staged, {"steps_completed": done, "default_output_uuid": output_uuid})
        store.completed_uploads(wait=True)  # stored before the job moves on
        if self.previous is not None:  # only the newest progress checkpoint is kept
            store.delete(self.previous)
        self.previous = uuid
        log.info("completed %d batches per rank; progress checkpointed", done)


def torch_batch_process(
    batch_processor_cls: type[TorchBatchProcessor],
    dataset: torch.utils.data.Dataset,
    batch_size: int | None = None,
    max_batches: int | None = None,
    checkpoint_interval: int = 5,
    dataloader_kwargs: dict[str, Any] | None = None,
    distributed_context: DistributedContext | None = None,
) -> None:
    """Run ``batch_processor_cls`` over ``dataset``, sharded across this job's ranks.

    ``max_batches`` caps the batches per rank; progress is checkpointed every
    ``checkpoint_interval`` batches (per rank).
    """
    if not isinstance(checkpoint_interval, int) or checkpoint_interval <= 0:
        raise ValueError(
            f"checkpoint_interval must be a positive integer, got {checkpoint_interval!r}"
        )
    kwargs = dict(dataloader_kwargs or {})
    _validate_dataloader_kwargs(kwargs, batch_size)
    if batch_size is None:
        batch_size = int(kwargs.pop("batch_size", DEFAULT_BATCH_SIZE))
    if not isinstance(dataset, collections.abc.Sized):
        raise TypeError(
            f"torch_batch_process needs a dataset with __len__ and __getitem__ (map-style), "
            f"got {type(dataset).__name__}; wrap an iterable in a map-style Dataset"
        )
    dataset_len = len(dataset)
    dist = _distributed(distributed_context)
    finished = False
    try:
        _process(
            batch_processor_cls,
            dataset,
            dataset_len,
            batch_size,
            max_batches,
            checkpoint_interval,
            kwargs,
            dist,
        )
        finished = True
    finally:
        if distributed_context is None:  # a failed rank must not wait for the others
            dist.close(wait_for_others=finished)


def _process(
    batch_processor_cls: type[TorchBatchProcessor],
    dataset: torch.utils.data.Dataset,
    dataset_len: int,
    batch_size: int,
    max_batches: int | None,
    checkpoint_interval: int,
    kwargs: dict[str, Any],
    dist: DistributedContext,
) -> None:
    rank, size = dist.get_rank(), dist.get_size()
    info = cluster_info.get_cluster_info()
    job_id, services = _open_job_services(dist, info)
    progress = _Progress(services, dist)
    succeeded = False
    try:
        latest = None
        if rank == 0:
            latest = (info.latest_checkpoint if info else None) or services.latest_progress()
        skip, output_uuid = dist.broadcast(progress.restore(latest) if rank == 0 else None)
        output_uuid = output_uuid or dist.broadcast(str(uuid_lib.uuid4()) if rank == 0 else None)
        if skip:
            log.info("resuming job %s: %d batches per rank already processed", job_id, skip)
        context = TorchBatchProcessorContext(
            dist,
            services,
            f"{output_uuid}/rank_{rank}",
            hparams=dict(info.trial.hparams) if info else {},
        )
        processor = batch_processor_cls(context=context)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, **kwargs)
        batches = iter(loader.get_data_loader(rank=rank, size=size, skip=skip))
        # Every rank takes the same number of steps (a short rank sees None) so the
        # collective at each checkpoint never waits for a rank that has finished.
        iterate_length = _iterate_length(max_batches, math.ceil(dataset_len / batch_size / size))
        last_checkpoint_idx = -1
        batch_idx = skip
        for batch_idx in range(skip, iterate_length):
            batch = next(batches, None)
            if batch is not None:
                processor.process_batch(batch=batch, batch_idx=batch_idx)
            if (batch_idx + 1) % checkpoint_interval == 0:
                processor.on_checkpoint_start()
                progress.save(batch_idx + 1, output_uuid)
                last_checkpoint_idx = batch_idx
        if batch_idx > last_checkpoint_idx:
            processor.on_checkpoint_start()
            progress.save(iterate_length, output_uuid)
        _report_reducers(context, services, dist, iterate_length)
        processor.on_finish()
        if rank == 0 and context._use_default_storage:
            log.info("files stored with upload_path() are at %s", services.output_uri(output_uuid))
        dist.gather(None)
        succeeded = True
    finally:
        services.close(succeeded)


def _open_job_services(
    dist: DistributedContext, info: cluster_info.ClusterInfo | None
) -> tuple[str, Any]:
    """The job id every rank agrees on, and this rank's services: the chief's open the
    job's run, the other ranks' write into it."""
    rank = dist.get_rank()
    job_id = dist.broadcast(default_job_id() if rank == 0 else None)
    name = str(((info.trial.config if info else None) or {}).get("name") or "batch-jobs")
    writer = (rank, dist.get_size())
    services = job_services(job_id, name, writer=writer) if rank == 0 else None
    run_id = dist.broadcast(getattr(services, "run_id", None))
    if services is None:
        services = job_services(job_id, name, chief=False, run_id=run_id, writer=writer)
    return job_id, services


def _report_reducers(
    context: TorchBatchProcessorContext,
    services: BatchJobServices,
    dist: DistributedContext,
    steps_completed: int,
) -> None:
    reducers = list(context._wrapped_reducers)
    if not reducers:
        return
    gathered = dist.gather([r.per_slot_reduce() for r in reducers])
    if gathered is not None:
        metrics = context.run_cross_slot_reduction(reducers, gathered)
        services.report_metrics("validation", steps_completed, metrics)
