"""``core.init()`` and ``core.Context``: a Core API script's view of the platform, built
from the one services object (``det_tasks.run_services``) a runner provides, or from its
local variants off the platform (Determined's ``_dummy_init``: checkpoints in a local
folder, one dummy searcher operation, metrics kept in memory and logged)."""

from __future__ import annotations

import logging
import os
import tempfile
import types
from pathlib import Path
from typing import Any

from det_tasks import run_services
from det_tasks.checkpoints.backends import store_from_config
from det_tasks.checkpoints.store import CheckpointStore, LocalDirectoryStore
from det_tasks.cluster_info import ClusterInfo
from det_tasks.core._checkpoint import CheckpointContext
from det_tasks.core._distributed import DummyDistributedContext
from det_tasks.core._preempt import PreemptContext, PreemptMode
from det_tasks.core._searcher import SearcherContext, configured_length, rung_stop
from det_tasks.core._tensorboard import scalar_writer
from det_tasks.core._train import EarlyExitReason, TensorboardMode, TrainContext
from det_tasks.distributed import DistributedContext
from det_tasks.errors import ConfigError, InvalidHP
from det_tasks.sinks import InMemoryMetricsSink, MetricsSink

__all__ = ["Context", "init", "local_checkpoint_dir"]

log = logging.getLogger("determined.core")


class Context:
    """``.train``, ``.checkpoint``, ``.preempt``, ``.searcher``, ``.distributed`` and
    ``.info`` (the cluster info; None off the platform). Use it as ``with core.init() as
    core_context:``: what it started is closed at the end of the block."""

    def __init__(
        self,
        checkpoint: CheckpointContext,
        distributed: DistributedContext,
        preempt: PreemptContext,
        train: TrainContext,
        searcher: SearcherContext,
        info: ClusterInfo | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.distributed = distributed
        self.preempt = preempt
        self.train = train
        self.searcher = searcher
        self.info = info

    def start(self) -> None:
        self.preempt.start()

    def __enter__(self) -> Context:
        self.start()
        return self

    def close(self, *exc_info: Any) -> None:
        self.preempt.close()
        try:
            self.checkpoint.close()
        finally:
            self.train.close()
            self.distributed.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: types.TracebackType | None,
    ) -> None:
        self.close(exc_type, exc_val, exc_tb)
        if isinstance(exc_val, InvalidHP):
            # Determined's rule: an InvalidHP raised in the block is an early exit, and the
            # script ends with exit code 0 (the runner tells the searcher to drop the trial).
            self.train.report_early_exit(EarlyExitReason.INVALID_HP)
            log.info("InvalidHP raised in core.init()'s block: the trial exits early")
            raise SystemExit(0)


def init(
    *,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """A ``core.Context`` for this process: on the platform, the trial's services (its
    MLflow run, S3 store, searcher length and stop requests); off it, local ones."""
    services = run_services.resolved()
    info = services.cluster_info if services is not None else None
    dist = distributed or DummyDistributedContext()
    conf = dict(info.trial.config) if info is not None else {}
    if distributed is None and _launched_size() > 1:
        raise ValueError(
            "you must provide a valid DistributedContext for a multi-slot task: "
            "core.init(distributed=core.DistributedContext.from_torch_distributed())"
        )
    control = services.control if services is not None else run_services.TrialControl()
    sink: MetricsSink = (services.metrics_sink if services else None) or InMemoryMetricsSink()
    store = _store(checkpoint_storage, services, info)
    tb_path = _tensorboard_path(services)
    auto = TensorboardMode(tensorboard_mode) == TensorboardMode.AUTO and dist.rank == 0
    events = scalar_writer(services.tensorboard_dir if services and auto else None)
    train = TrainContext(
        sink, control, dist, tb_path, tensorboard_mode, conf.get("searcher"), events
    )
    train.set_experiment_best(info.experiment_best if info is not None else None)
    checkpoint = CheckpointContext(
        store, sink, dist, control, _describer(train, info), steps_required=info is not None
    )
    searcher = _searcher(dist, services, conf)
    length = services.searcher_length if services is not None else None
    stop_here = rung_stop(searcher, length, conf, control)
    preempt = PreemptContext(control, dist, preempt_mode, stop_here)
    return Context(checkpoint, dist, preempt, train, searcher, info)


def _searcher(
    dist: DistributedContext, services: run_services.RunServices | None, conf: dict[str, Any]
) -> SearcherContext:
    """The searcher's one operation: off the platform of length 1 (Determined's dummy)."""
    if services is None or services.cluster_info is None:
        return SearcherContext(dist, 1, None, None)
    length, units = configured_length(services.searcher_length, conf)
    if length is None:
        return _NoLengthSearcher(dist, 0, units, services)
    return SearcherContext(dist, length, units, services)


class _NoLengthSearcher(SearcherContext):
    def operations(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            "searcher.operations() needs a length: set searcher.max_length in the experiment "
            "config (e.g. max_length: {batches: 1000}), or set the length in the script"
        )


def _launched_size() -> int:
    return max(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("HOROVOD_SIZE", "1")))


def local_checkpoint_dir() -> Path:
    """Where checkpoints go off the platform with no ``checkpoint_storage``: Determined's
    user data folder (``~/.local/share/determined`` on Linux)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "determined"


def _store(
    checkpoint_storage: str | dict[str, Any] | None,
    services: run_services.RunServices | None,
    info: ClusterInfo | None,
) -> CheckpointStore:
    """The platform's store; else ``checkpoint_storage`` (a folder, or a config section of
    type shared_fs or directory); else the launched trial's folder or the local default."""
    if checkpoint_storage is not None:
        return _store_from_argument(checkpoint_storage)
    if services is not None and services.checkpoint_store is not None:
        return services.checkpoint_store  # type: ignore[no-any-return]
    if info is not None:
        return LocalDirectoryStore(info.checkpoint_dir)
    path = local_checkpoint_dir()
    log.info("no checkpoint_storage given; storing checkpoints in %s", path)
    return LocalDirectoryStore(path)


def _store_from_argument(storage: str | dict[str, Any]) -> CheckpointStore:
    if isinstance(storage, str):
        if "://" in storage and not storage.startswith("file://"):
            raise ConfigError(
                f"core.init(checkpoint_storage={storage!r}): cloud URIs are not supported by "
                "det_tasks here; on the platform leave checkpoint_storage out (the trial's S3 "
                "store is used), or give a local folder"
            )
        return LocalDirectoryStore(storage.removeprefix("file://"))
    if isinstance(storage, dict):  # a config's section: its type's local store
        try:
            return store_from_config({"checkpoint_storage": storage})
        except ConfigError as err:
            raise ConfigError(
                f"core.init(checkpoint_storage={storage!r}): {err}. On the platform leave "
                "it out: the trial's store is used"
            ) from None
    raise TypeError(f"checkpoint_storage must be a str, a dict or None, got {storage!r}")


def _tensorboard_path(services: run_services.RunServices | None) -> Path:
    if services is not None and services.tensorboard_dir:
        return Path(services.tensorboard_dir)
    return Path(tempfile.gettempdir()) / f"tensorboard-{os.getpid()}"


def _describer(train: TrainContext, info: ClusterInfo | None) -> Any:
    """What the platform adds to a checkpoint's metadata at a step: the trial id and the
    validation metrics reported at that step, as a PyTorchTrial's checkpoint has."""
    trial_id = str(info.trial.trial_id) if info is not None else "local"

    def describe(steps: int) -> dict[str, Any]:
        last = train.last_validation
        validation = last[1] if last is not None and last[0] == steps else None
        return {"trial_id": trial_id, "validation_metrics": validation}

    return describe
