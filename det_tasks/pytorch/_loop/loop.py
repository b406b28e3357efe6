"""The training loop: one trial, from its latest checkpoint to max_length.

Read ``run`` top to bottom: restore, then ``while`` not done: train a batch, then report,
validate and checkpoint at their boundaries. Everything per batch is O(1) Python work:
metrics stay on the device until a reporting boundary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from det_tasks import __version__
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.errors import CheckpointError, TrialError
from det_tasks.pytorch._api import parallel as _parallel
from det_tasks.pytorch._api.callback import PyTorchCallback, adapt_legacy_signatures
from det_tasks.pytorch._api.context import PyTorchTrialContext
from det_tasks.pytorch._api.lr_scheduler import LRScheduler
from det_tasks.pytorch._api.nonfinite import report_count as report_nonfinite
from det_tasks.pytorch._data.feeder import DevicePrefetcher, iterate_batches
from det_tasks.pytorch._data.length import epoch_length, plain_loader_refusal
from det_tasks.pytorch._data.loader import DataLoader, to_device
from det_tasks.pytorch._data.units import Batch, TrainUnit
from det_tasks.pytorch._loop.checkpointing import CheckpointFiles, CheckpointWriter
from det_tasks.pytorch._loop.metrics import (
    TrainingMetricsBuffer,
    average_across_ranks,
    check_metrics,
)
from det_tasks.pytorch._loop.profiler import PhaseTimer, ProfilerSettings
from det_tasks.pytorch._loop.restore import load_state, open_checkpoint, overridden
from det_tasks.pytorch._loop.tensorboard import metric_event_writer
from det_tasks.pytorch._loop.validation import validate
from det_tasks.run_services import TrialControl
from det_tasks.sinks import MetricsSink, record_position_on

__all__ = ["FitOptions", "TrialController"]

log = logging.getLogger(__name__)
_TRIAL_STATE = "trial_state"


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """Trainer.fit's arguments, resolved and checked."""

    max_length: TrainUnit
    checkpoint_period: TrainUnit | None = None
    validation_period: TrainUnit | None = None
    reporting_period: TrainUnit = dataclasses.field(default_factory=lambda: Batch(100))
    checkpoint_policy: str = "best"
    latest_checkpoint: str | None = None
    warm_start: str | None = None  # searcher.source_*: weights from here, progress from 0
    step_zero_validation: bool = False
    test_mode: bool = False
    searcher_metric: str | None = None
    smaller_is_better: bool = True
    profiling: ProfilerSettings | None = None


class TrialController:
    """Runs one trial under one context; holds the loop's position and best metric."""

    def __init__(
        self,
        trial: Any,
        context: PyTorchTrialContext,
        options: FitOptions,
        sink: MetricsSink,
        store: CheckpointStore,
    ) -> None:
        self.trial = trial
        self.context = context
        self.options = options
        self.sink = sink
        self.store = store
        self.dist = context.distributed
        self.callbacks: dict[str, PyTorchCallback] = _check_callbacks(trial.build_callbacks())
        self.batches_trained = 0
        self.best_metric: float | None = None
        # Set by an orchestrator running a search: checkpoint_policy "best" then means better
        # than the experiment's best so far, as in Determined, not only this trial's best.
        self.experiment_best: float | None = None
        self.last_validation_batch: int | None = None
        self.last_checkpoint_batch: int | None = None
        self.latest_checkpoint_uuid: str | None = options.latest_checkpoint
        self.latest_validation: dict[str, Any] | None = None
        self._buffer = TrainingMetricsBuffer()
        self._timer = PhaseTimer(options.profiling, context.device)
        # One process, no profiling window: no phase timer or DDP no_sync to enter per batch.
        self._bare_steps = self._timer.settings is None and self.dist.size == 1
        self._next_boundary = 0  # batch count before which _at_boundaries has nothing to do
        # The runner's control (run_services.TrialControl) of whoever drives the loop step
        # by step (a held trial): its stop request, set from another thread (a pause,
        # cancel or preemption), stops the loop at the next batch boundary (one read per
        # batch, as Determined polls preemption); abandoned, the stop reports nothing, since
        # the replay from the last checkpoint reports those batches again.
        self.control: TrialControl | None = None
        self._writer = CheckpointWriter(store, context.device)
        self._events = metric_event_writer(context) if self.dist.is_chief else None
        self._rng_for_checkpoint: dict[str, Any] | None = None
        self._shuffle_draws: dict[int, Any] | None = None  # a checkpoint's, for its epoch
        if not context.models:
            raise TrialError(
                f"{type(trial).__name__}.__init__ wrapped no model: wrap every model with "
                "self.context.wrap_model(model) so it is moved to the device and checkpointed"
            )

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        try:
            self.train_until(self.max_batches)
            self._finish()
        finally:
            self.stop()

    # A held trial (det_tasks.runner.held) drives these steps one task at a time.
    def start(self) -> None:
        """Restore, build the data, and run the startup hooks: ready to train."""
        # Determined's order, which fixes the global RNG streams a trial sees: startup
        # callbacks, the data loaders and the training iterator (whose creation draws from
        # the global torch generator), then the checkpoint's state, RNG states included.
        state = self._read_checkpoint(self.options.latest_checkpoint)
        if state is None and self.options.warm_start is not None:
            state = self._read_warm_start(self.options.warm_start)
        for cb in self.callbacks.values():
            cb.on_trial_startup(self.batches_trained, self.latest_checkpoint_uuid)
        try:
            self._build_data()
            if state is not None:
                load_state(self.context, self.callbacks, state)
            watch = getattr(self.sink, "watch_progress", None)  # a progress bar reads our counter
            if watch is not None and self.dist.is_chief:
                watch(lambda: self.batches_trained, self.epoch_len, self.max_batches)
            for cb in self.callbacks.values():
                cb.on_training_start()
            if self.options.step_zero_validation and self.batches_trained == 0:
                self._validate()
            self._install_before_step_hooks()
            self._record_position()
        except BaseException:
            self.stop()
            raise

    def train_until(self, batches: int) -> None:
        """Train (validating/checkpointing at their periods) until ``batches`` in total or
        until the trial asks to stop."""
        for model in self.context.models:
            model.train()
        profiler = self.context.profiler
        until = min(batches, self.max_batches)
        with profiler if profiler is not None else contextlib.nullcontext():
            while self.batches_trained < until:
                self._train_batch()
                if profiler is not None:
                    profiler.step()
                self._at_boundaries()
                control = self.control
                if self.context._stop_requested or (
                    control is not None and control.should_preempt()
                ):
                    # Reported now: a kill takes no checkpoint (whose step would report it),
                    # so MLflow's progress/batches would stay at the last scheduling unit.
                    if control is None or not control.abandoned.is_set():
                        self._report_training()
                    break
        self._record_position()

    def _record_position(self) -> None:
        """Where the loop stands, for whoever ends the trial's run (sinks.record_position_on)."""
        record_position_on(
            self.sink,
            self.batches_trained,
            self.max_batches,
            bool(self.context.get_stop_requested()),
        )

    def validate_now(self) -> dict[str, Any] | None:
        """Report training and validate at the current batch (once per batch)."""
        self._report_training()
        self._timer.flush(self.batches_trained, self.sink if self.dist.is_chief else None)
        done = self.batches_trained
        if not self.context.get_stop_requested() and self.last_validation_batch != done:
            # A validation only because training stops here (not due by its period) leaves
            # the training stream's RNG state as it was, and a checkpoint here keeps that
            # state, so a run continued from it, or in memory, equals one that never
            # stopped (Determined's pause/resume checkpoints without validating).
            before = ckpt.capture_rng_state(self.context.device)
            self._rng_for_checkpoint = before
            try:
                self._validate()
            finally:
                self._rng_for_checkpoint = None
            ckpt.restore_rng_state(before, self.context.device)
        return self.latest_validation

    def checkpoint_now(self) -> str | None:
        """Checkpoint at the current batch (once per batch) and wait for its upload."""
        if self.last_checkpoint_batch != self.batches_trained:
            self._checkpoint()
        self._drain_uploads(wait=True)
        return self.latest_checkpoint_uuid

    def stop(self) -> None:
        self._writer.close()  # a checkpoint being written in the background is finished
        self._close_data()
        for cb in self.callbacks.values():
            cb.on_trial_shutdown()

    def _train_batch(self) -> None:
        ctx, idx = self.context, self.batches_trained
        ctx._current_batch_idx = idx
        if not self._buffer.count:  # a training window starts: fresh reducers, as Determined
            ctx.experimental.reset_reducers()
        epoch_idx = idx // self.epoch_len
        if self._bare_steps:
            batch = next(self._train_iter)
        else:
            with self._timer.phase(idx, "dataloader_next"):
                batch = next(self._train_iter)
        if idx % self.epoch_len == 0:
            for cb in self.callbacks.values():
                cb.on_training_epoch_start(epoch_idx)
        stepping = ctx._should_communicate_and_update()
        if self._bare_steps:
            metrics = self.trial.train_batch(batch=batch, epoch_idx=epoch_idx, batch_idx=idx)
        else:
            with (
                self._timer.phase(idx, "train_batch"),
                _parallel.no_sync(ctx.models, active=self.dist.size > 1 and not stepping),
            ):
                metrics = self.trial.train_batch(batch=batch, epoch_idx=epoch_idx, batch_idx=idx)
        if stepping and ctx.experimental._auto_amp and ctx._scaler is not None:
            ctx._scaler.update()
        metrics = check_metrics(metrics, "train_batch")
        if stepping:
            for scheduler in ctx.lr_schedulers:
                self._step_scheduler(scheduler, idx)
        self._buffer.add(metrics)
        self.batches_trained = idx + 1
        if self.batches_trained % self.epoch_len == 0:
            for cb in self.callbacks.values():
                cb.on_training_epoch_end(epoch_idx)

    def _step_scheduler(self, scheduler: LRScheduler, idx: int) -> None:
        mode, freq = scheduler._step_mode, scheduler._frequency
        agg = self.context._settings.aggregation_frequency
        if mode is LRScheduler.StepMode.STEP_EVERY_BATCH:
            for i in range(idx - agg + 1, idx + 1):
                if (i + 1) % freq == 0:
                    scheduler.step()
        elif mode is LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
            if ((idx + 1) // agg) % freq == 0:
                scheduler.step()
        elif mode is LRScheduler.StepMode.STEP_EVERY_EPOCH:
            # Step for every epoch that ends before the next optimizer step.
            for epoch in range(idx // self.epoch_len, (idx + agg) // self.epoch_len):
                if (epoch + 1) % freq == 0:
                    scheduler.step()

    def _at_boundaries(self) -> None:
        done, opts, n = self.batches_trained, self.options, self.epoch_len
        if done < self._next_boundary and not self.context._stop_requested:
            return  # nothing is due before then: one comparison per batch
        self._next_boundary = self._boundary_after(done)
        validate_due = opts.validation_period is not None and opts.validation_period.is_due(done, n)
        checkpoint_due = opts.checkpoint_period is not None and opts.checkpoint_period.is_due(
            done, n
        )
        if (
            opts.reporting_period.is_due(done, n)
            or validate_due
            or checkpoint_due
            or self.context.get_stop_requested()
            or opts.test_mode
        ):
            self._report_training()
        self._timer.maybe_report(done, self.sink if self.dist.is_chief else None)
        if validate_due:
            self._validate()
        if checkpoint_due and self.last_checkpoint_batch != done:
            self._checkpoint()

    def _boundary_after(self, done: int) -> int:
        """The next batch count at which a report, validation or checkpoint is due (every
        batch while the profiler's window is open)."""
        if self._timer.settings is not None:
            return done + 1
        opts, n = self.options, self.epoch_len
        periods = (opts.reporting_period, opts.validation_period, opts.checkpoint_period)
        dues = [p.next_due(done, n) for p in periods if p is not None]
        return min((d for d in dues if d is not None), default=sys.maxsize)

    def _finish(self) -> None:
        self.validate_now()
        self.checkpoint_now()

    # ---- data ---------------------------------------------------------------------------
    def _build_data(self) -> None:
        ctx, opts = self.context, self.options
        train_loader = _check_loader(self.trial.build_training_data_loader(), "training", ctx)
        self._train_loader = train_loader
        self._val_loader = _check_loader(
            self.trial.build_validation_data_loader(), "validation", ctx
        )
        lengths = {
            "searcher.max_length": opts.max_length,
            "min_validation_period": opts.validation_period,
            "min_checkpoint_period": opts.checkpoint_period,
        }
        epoch_len = epoch_length(train_loader, self.dist.size, lengths)
        self.epoch_len = epoch_len
        ctx._epoch_len = epoch_len
        self.max_batches = 1 if opts.test_mode else opts.max_length.to_batches(epoch_len)
        if self.batches_trained > self.max_batches:
            raise CheckpointError(
                f"the checkpoint has {self.batches_trained} batches trained, more than "
                f"max_length {opts.max_length} ({self.max_batches} batches)"
            )
        source = iterate_batches(
            train_loader,
            seed=ctx.get_trial_seed(),
            rank=self.dist.rank,
            size=self.dist.size,
            repeat=True,
            skip=self.batches_trained,
            shuffle_draws=self._shuffle_draws,
        )
        self._prefetcher: DevicePrefetcher | None = None
        auto = ctx.experimental._auto_to_device
        if auto and ctx.device.type == "cuda" and _thread_safe_source(train_loader):
            self._prefetcher = DevicePrefetcher(source, ctx.device)
            self._train_iter: Iterator[Any] = self._prefetcher
        elif auto:
            self._train_iter = map(to_device, source, itertools.repeat(ctx.device))
        else:
            self._train_iter = source

    def _close_data(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            assert self._prefetcher is not None
            self._prefetcher.close()

    # ---- reporting and validation ---------------------------------------------------------
    def _report_training(self) -> None:
        nonfinite = self.context._nonfinite.check()  # before any metric or checkpoint
        if not self._buffer.count:
            return
        avg, batch_metrics = self._buffer.flush()
        ctx = self.context
        if self.dist.size > 1 and ctx._settings.average_training_metrics:
            avg = average_across_ranks(self.dist.allgather(avg))
        if self.dist.size > 1 and ctx._nonfinite.policy == "warn":
            nonfinite = sum(self.dist.allgather(nonfinite))
        avg.update(ctx.experimental.reduce_metrics(for_training=True))
        for name, value in avg.items():
            if isinstance(value, float) and not math.isfinite(value):
                log.warning(
                    "training metric %r is %s at batch %d", name, value, self.batches_trained
                )
        for cb in self.callbacks.values():
            cb.on_training_workload_end(avg, batch_metrics)
        if self.dist.is_chief:
            self.sink.report_training(self.batches_trained, avg)
            report_nonfinite(self.sink, self.batches_trained, nonfinite)
            if self._events is not None:
                self._events.training(self.batches_trained, avg, batch_metrics)
            progress = getattr(self.sink, "report_progress", None)
            if progress is not None:
                progress(self.batches_trained, self.batches_trained / self.epoch_len)
        self._drain_uploads(wait=False)

    def _validate(self) -> None:
        self._report_training()
        metrics = validate(
            self.trial,
            self.context,
            self._val_loader,
            self.callbacks,
            test_mode=self.options.test_mode,
        )
        self.last_validation_batch = self.batches_trained
        self.latest_validation = metrics
        if self.dist.is_chief:
            self.sink.report_validation(self.batches_trained, metrics)
            if self._events is not None:
                self._events.validation(self.batches_trained, metrics)
        already_saved = self.last_checkpoint_batch == self.batches_trained
        if not already_saved and self._should_checkpoint_after_validation(metrics):
            self._checkpoint()

    def _should_checkpoint_after_validation(self, metrics: dict[str, Any]) -> bool:
        policy, name = self.options.checkpoint_policy, self.options.searcher_metric
        if policy == "all":
            return True
        if policy != "best" or name is None:
            return False
        if name not in metrics:
            raise TrialError(
                f"the searcher metric {name!r} is not among the validation metrics "
                f"{sorted(metrics)}; return it from evaluate_batch() or change searcher.metric"
            )
        value = float(metrics[name])
        beats_experiment = self._beats(value, self.experiment_best)
        if self._beats(value, self.best_metric):
            self.best_metric = value
            return beats_experiment
        return False

    def _beats(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value < best if self.options.smaller_is_better else value > best

    # ---- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self) -> None:
        self._report_training()
        uuid: str | None = None
        if self.dist.is_chief:
            uuid = self._write_checkpoint()
        uuid = self.dist.broadcast(uuid)
        self.latest_checkpoint_uuid = uuid
        self.last_checkpoint_batch = self.batches_trained
        self._drain_uploads(wait=False)

    def _drain_uploads(self, wait: bool) -> None:
        """Report checkpoints written in the background, and run on_checkpoint_upload_end for
        every one whose upload finished (chief only)."""
        if not self.dist.is_chief:
            return
        for uuid, metadata in self._writer.finished(wait=wait):
            self.sink.report_checkpoint(metadata["steps_completed"], uuid, metadata)
        for uuid in self.store.completed_uploads(wait=wait):
            for cb in self.callbacks.values():
                cb.on_checkpoint_upload_end(uuid)

    def _state(self) -> dict[str, Any]:
        ctx = self.context
        state: dict[str, Any] = {
            "models_state_dict": [m.state_dict() for m in ctx.models],
            "optimizers_state_dict": [o.state_dict() for o in ctx.optimizers],
            "lr_schedulers_state_dict": [s.state_dict() for s in ctx.lr_schedulers],
            "callbacks": {name: cb.state_dict() for name, cb in self.callbacks.items()},
            "rng_state": self._rng_for_checkpoint or ckpt.capture_rng_state(ctx.device),
            _TRIAL_STATE: {
                "batches_trained": self.batches_trained,
                "best_metric": self.best_metric,
                "last_validation_batch": self.last_validation_batch,
                "shuffle_draws": _shuffle_draws(self._train_loader),
            },
        }
        if ctx._scaler is not None:
            state["scaler_state_dict"] = ctx._scaler.state_dict()
        return state

    def _write_checkpoint(self) -> str:
        ctx = self.context
        state = self._state()
        for cb in self.callbacks.values():
            cb.on_checkpoint_save_start(state)
        trial_cls = getattr(self.trial, "_det_tasks_user_class", type(self.trial))
        files = CheckpointFiles(
            load_data={
                "trial_type": "PyTorchTrial",
                "trial_cls_spec": f"{trial_cls.__module__}:{trial_cls.__qualname__}",
                "hparams": ctx.get_hparams(),
                "experiment_config": ctx._settings.exp_conf,
            },
            model_dir=Path(ctx._settings.model_dir) if ctx._settings.model_dir else None,
            metadata={
                "det_tasks_version": __version__,
                "torch_version": torch.__version__,
                "steps_completed": self.batches_trained,
                "trial_id": str(ctx.get_trial_id()),
                "validation_metrics": self.latest_validation
                if self.last_validation_batch == self.batches_trained
                else None,
                "time": time.time(),
            },
        )
        # These need the files on this thread, so with any of them the write is synchronous.
        write_end: list[Callable[[str], None]] = []
        for cb in self.callbacks.values():
            if overridden(cb, "on_checkpoint_end"):
                write_end.append(cb.on_checkpoint_end)
            if overridden(cb, "on_checkpoint_write_end"):
                write_end.append(cb.on_checkpoint_write_end)
        return self._writer.save(state, files, write_end, self.latest_checkpoint_uuid)

    def _read_checkpoint(self, reference: str | None) -> dict[str, Any] | None:
        """The checkpoint's state (applied once the data is built) and the loop's position."""
        if reference is None:
            return None
        with open_checkpoint(self.store, reference) as path:
            metadata = ckpt.verify(path)
            state = ckpt.read_state(path)
            trial_state = state.get(_TRIAL_STATE) or _legacy_trial_state(path)
        self.batches_trained = int(trial_state["batches_trained"])
        self.context._initial_batch = self.batches_trained
        self.best_metric = trial_state.get("best_metric")
        self.last_validation_batch = trial_state.get("last_validation_batch")
        self._shuffle_draws = trial_state.get("shuffle_draws")
        self.last_checkpoint_batch = self.batches_trained
        if self.last_validation_batch == self.batches_trained:
            # Validated just before this checkpoint: its metrics stand for this position.
            self.latest_validation = (metadata or {}).get("validation_metrics")
        return state

    def _read_warm_start(self, reference: str) -> dict[str, Any]:
        """Every piece of state from another trial's checkpoint, but none of its progress
        (Determined: the checkpoint's trial id differs, so its trial state is dropped)."""
        with open_checkpoint(self.store, reference) as path:
            ckpt.verify(path)
            return ckpt.read_state(path)

    def _install_before_step_hooks(self) -> None:
        hooks = [cb for cb in self.callbacks.values() if overridden(cb, "on_before_optimizer_step")]
        if hooks:
            warnings.warn(
                "PyTorchCallback.on_before_optimizer_step is deprecated; pass clip_grads= to "
                "context.step_optimizer() instead",
                DeprecationWarning,
                stacklevel=2,
            )
        self.context._before_step_hooks = [cb.on_before_optimizer_step for cb in hooks]


def _legacy_trial_state(path: Path) -> dict[str, Any]:
    return ckpt.determined_progress(path)


def _check_callbacks(callbacks: Any) -> dict[str, PyTorchCallback]:
    if not isinstance(callbacks, dict) or not all(
        isinstance(k, str) and isinstance(v, PyTorchCallback) for k, v in callbacks.items()
    ):
        raise TrialError(
            "build_callbacks() must return a dict of names to PyTorchCallback instances, "
            f"got {callbacks!r}"
        )
    return adapt_legacy_signatures(callbacks)


def _check_loader(loader: Any, which: str, ctx: PyTorchTrialContext) -> Any:
    if isinstance(loader, DataLoader):
        return loader
    if isinstance(loader, torch.utils.data.DataLoader):
        if which == "validation" or not ctx.experimental._data_repro_checks:
            return loader
        raise TrialError(plain_loader_refusal(loader))
    raise TrialError(
        f"build_{which}_data_loader() must return a det_tasks.pytorch.DataLoader, got "
        f"{type(loader).__name__}"
    )


def _thread_safe_source(loader: Any) -> bool:
    """Fetching in a thread is safe when it cannot race the main thread for global RNG."""
    return (
        isinstance(loader, DataLoader)
        and (loader.supports_fast_gather() or loader.num_workers > 0)
        and not loader.draws_from_global_rng()
    )


def _shuffle_draws(loader: Any) -> dict[int, Any]:
    """The training shuffle's draws of the epochs in flight (Determined's order is drawn
    from the global generator per epoch; a resumed run replays it from these)."""
    return loader.shuffle_draws() if isinstance(loader, DataLoader) else {}
