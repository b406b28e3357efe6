"""A trial built once and held in this process between tasks: train to batch N, validate,
checkpoint, and restore from a checkpoint at a position.

This is what a warm worker (``cluster.held_trials``) keeps between a trial's train, validate and
checkpoint tasks, so a task costs only its work: no interpreter, import, model build or
MLflow run set-up per segment. It reuses the local runner's pieces (config, platform
services, resume choice) and drives the same training loop as ``Trainer.fit`` step by step,
so a held trial's weights equal ``det-tasks run``'s, segment for segment.

Global RNG state (Python, numpy, torch) is process-wide: each step restores the trial's own
state before it runs and captures it after, so whatever else ran in this process between two
steps cannot change the trial's random stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from det_tasks import run_services
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.references import scheme_of
from det_tasks.config import ExperimentConfig
from det_tasks.errors import ConfigError
from det_tasks.pytorch import Trainer, init
from det_tasks.pytorch.harness import trial_controller
from det_tasks.runner.entrypoint import load_trial_class_or_fail, model_dir_on_path
from det_tasks.runner.resume import choose_resume_checkpoint
from det_tasks.runner.trial_config import with_defaults
from det_tasks.runner.trial_setup import (
    checkpoint_store_for,
    fit_periods,
    platform_services,
    resolved_model_dir,
    train_unit,
    trial_hparams,
)
from det_tasks.runner.trial_spec import TrialSpec, entered_config, holdable, trial_config
from det_tasks.runner.workdir import in_model_dir
from det_tasks.sinks import InMemoryMetricsSink, MetricsSink

# TrialSpec and its helpers live in runner.trial_spec (no torch: the flow builds specs);
# named here too, as a held trial's inputs.
__all__ = ["HeldTrial", "TrialSpec", "entered_config", "holdable", "trial_config"]


class HeldTrial:
    """One PyTorchTrial, built and kept in memory; its position is ``position`` batches."""

    def __init__(self, spec: TrialSpec, resume: Sequence[str] | None = None) -> None:
        """Build the trial and restore it from the first intact checkpoint in ``resume``
        (newest first); with none, it starts at batch 0."""
        self.spec = spec
        raw, config = trial_config(spec)
        why_not = holdable(config)
        if why_not is not None:
            raise ConfigError(f"trial {spec.trial_id} cannot be held in one process: {why_not}")
        self._model_dir = resolved_model_dir(Path(spec.model_dir))  # its code runs there
        hparams = trial_hparams(config, spec.hparams or None)
        self._stack = contextlib.ExitStack()
        try:
            latest = self._build(raw, config, hparams, resume)
        except BaseException as err:
            self._stack.__exit__(type(err), err, err.__traceback__)
            raise
        self.hparams = hparams
        self.restored_from = latest
        self.max_batches = self._controller.max_batches

    def _build(
        self,
        raw: dict[str, Any],
        config: ExperimentConfig,
        hparams: dict[str, Any],
        resume: Sequence[str] | None,
    ) -> str | None:
        """Load the class, open the services, build the trial and start its controller,
        each on ``self._stack``; returns the checkpoint it restored from."""
        spec, model_dir = self.spec, Path(self.spec.model_dir)
        # The entrypoint loads before any MLflow run exists (a wrong class leaves none).
        self._stack.enter_context(model_dir_on_path(model_dir))
        assert isinstance(config.entrypoint, str)
        with in_model_dir(self._model_dir):
            trial_class = load_trial_class_or_fail(config.entrypoint, model_dir)
        services = self._stack.enter_context(
            platform_services(
                raw,
                config,
                hparams,
                model_dir,
                Path(spec.config_path),
                None,
                str(spec.trial_id),
                spec.experiment_run_key,
            )
        )
        store = checkpoint_store_for(services, raw, None, config)
        sink: MetricsSink = services.metrics_sink if services else InMemoryMetricsSink()
        self._stack.callback(sink.close)
        # Entered per step, not held: a context variable set in one task cannot be
        # reset in another (each runs in its own contextvars context).
        self._services = services
        latest = choose_resume_checkpoint(store, list(resume) if resume else None)
        with run_services.provide(services), in_model_dir(self._model_dir):
            context = self._stack.enter_context(
                init(
                    hparams=hparams,
                    exp_conf=with_defaults(raw, config),
                    metrics_sink=sink,
                    checkpoint_store=store,
                    device=spec.device,
                    seed=config.reproducibility.experiment_seed,
                    model_dir=self._model_dir,
                    trial_id=spec.trial_id,
                )
            )
            self._device = context.device
            self._controller = trial_controller(
                Trainer(trial_class(context), context),
                max_length=train_unit(config, config.max_length, hparams.get("global_batch_size")),
                latest_checkpoint=latest,
                **fit_periods(config, hparams),
            )
            self._controller.start()
            self._stack.callback(self._controller.stop)
            self._rng = ckpt.capture_rng_state(self._device)
        return latest

    @property
    def position(self) -> int:
        """Batches trained so far."""
        return self._controller.batches_trained

    @property
    def stop_requested(self) -> bool:
        return bool(self._controller.context.get_stop_requested())

    def set_experiment_best(self, value: float | None) -> None:
        """The experiment's best searcher metric so far: checkpoint_policy ``best`` then
        checkpoints a validation only when it beats it (Determined's rule under a search)."""
        self._controller.experiment_best = value

    def train_to(
        self,
        batches: int,
        control: run_services.TrialControl | threading.Event | None = None,
        abandoned: threading.Event | None = None,
    ) -> int:
        """Train until ``batches`` in total (or until the trial asks to stop, or the
        runner's ``control`` asks it to: then at the next batch boundary); returns the
        position reached. Periodic validations and checkpoints happen on the way. A control
        that abandons the training stops without reporting the batches since the last
        report: they are trained again from the last checkpoint elsewhere. ``control`` may
        be given as its stop event, with ``abandoned``."""
        if batches < self.position:
            raise ValueError(
                f"trial {self.spec.trial_id} is at batch {self.position}, past {batches}: "
                "restore an earlier checkpoint to go back"
            )
        if isinstance(control, threading.Event):
            control = run_services.TrialControl(stop=control, abandoned=abandoned)
        self._controller.control = control
        try:
            with self._step():
                self._controller.train_until(batches)
        finally:
            self._controller.control = None
        return self.position

    def validate(self) -> dict[str, Any] | None:
        """Validation metrics at the current position (computed once per position)."""
        with self._step():
            return self._controller.validate_now()

    def checkpoint(self) -> tuple[str | None, str | None]:
        """Checkpoint at the current position (once per position); (uuid, uri)."""
        with self._step():
            uuid = self._controller.checkpoint_now()
        if uuid is None or scheme_of(uuid) is not None or Path(uuid).is_dir():
            return uuid, uuid  # restored from this reference, nothing newer written
        return uuid, self._controller.store.uri(uuid)

    def close(self, error: BaseException | None = None) -> None:
        """Release the trial: its data, hooks, context and MLflow run (ended FAILED when
        ``error`` is given). Idempotent."""
        stack, self._stack = self._stack, contextlib.ExitStack()
        services = run_services.provide(self._services)
        with services, in_model_dir(self._model_dir):  # callbacks' on_trial_shutdown
            if error is None:
                stack.close()
            else:
                stack.__exit__(type(error), error, error.__traceback__)

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """The trial's own RNG state and run services for the duration of one step."""
        scope = run_services.provide(self._services)
        ckpt.restore_rng_state(self._rng, self._device)
        try:
            with scope, in_model_dir(self._model_dir):
                yield
        finally:
            self._rng = ckpt.capture_rng_state(self._device)
