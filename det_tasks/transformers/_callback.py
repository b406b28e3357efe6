"""``DetCallback``: what Determined's Hugging Face callback does, on ``det_tasks.core``.

- Reports the Trainer's logs: training logs (``loss``, ``learning_rate``...) as training
  metrics and ``eval_*`` logs as validation metrics, at ``state.global_step``, each step
  once; the end-of-training averages (``train_*``) are not reported, as in Determined.
- Stores every checkpoint the Trainer saves (``checkpoint-N/`` and ``runs/``) through
  ``core_context.checkpoint.upload`` with ``steps_completed``.
- Downloads ``latest_checkpoint`` into ``args.output_dir`` and points
  ``args.resume_from_checkpoint`` at it, so ``trainer.train(resume_from_checkpoint=
  args.resume_from_checkpoint)`` continues.
- Follows the searcher's operations (progress, completion with the searcher metric) and
  stops training when they end; with Determined 0.38's searcher form (no length) the
  Trainer trains its own length and a rung's stop arrives as a stop request.
- On a stop request (pause, preemption) it makes the Trainer save, then stops training.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import transformers
from transformers import trainer_utils

from det_tasks import cluster_info
from det_tasks.errors import ConfigError

__all__ = ["DetCallback", "get_metric_type"]

log = logging.getLogger("determined.transformers")

EVAL = "eval_"
TEST = "test_"
TRAIN_AVG = "train_"
TRAIN = "train_progress"


class DetCallback(transformers.TrainerCallback):  # type: ignore[misc]
    """Report a ``Trainer`` to the platform through ``core_context``; ``filter_metrics``
    keeps only logs whose names contain one of its strings; ``user_data`` is written as
    ``my_data.json`` into each checkpoint."""

    def __init__(
        self,
        core_context: Any,
        args: transformers.TrainingArguments,
        filter_metrics: list[str] | None = None,
        user_data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.core_context = core_context
        self.filter_metrics = filter_metrics
        self.user_data = user_data
        info = cluster_info.get_cluster_info()
        if info is None:
            raise RuntimeError(
                "DetCallback needs a launched trial (det.get_cluster_info() is None): run the "
                "script with `det-tasks run CONFIG` or `det experiment create CONFIG .`"
            )
        self.info = info
        self.load_last_checkpoint(args, info)
        self.last_metrics: dict[str, Any] = {"train_step": -1, "eval_step": -1}
        self.updating_searcher = False
        searcher = dict(info.trial.config.get("searcher") or {})
        self.searcher_metric = searcher.get("metric")
        self._follow_operations(core_context, searcher, args)

    def _follow_operations(
        self, core_context: Any, searcher: dict[str, Any], args: transformers.TrainingArguments
    ) -> None:
        """The searcher's operations, where the trial has a length (``max_length``, or a
        rung's); in Determined 0.38's form (``time_metric``/``max_time``, no length) there
        are none: the Trainer trains its own length, and a rung's stop arrives as
        ``should_preempt()``."""
        try:
            self.searcher_ops: Any = core_context.searcher.operations()
            self.current_op: Any = next(self.searcher_ops)
        except ConfigError:
            self.searcher_ops = self.current_op = None
            self.searcher_unit, self.searcher_max_length = None, None
            return
        if searcher.get("name") == "custom" or not isinstance(searcher.get("max_length"), dict):
            self.searcher_unit, self.searcher_max_length = "batches", self.current_op.length
        else:
            ((self.searcher_unit, self.searcher_max_length),) = searcher["max_length"].items()
            self._check_searcher_compatibility(args)

    # ---- metrics -----------------------------------------------------------------------
    def on_log(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None:
            log.warning("on_log called without logs")
            return
        metrics, kind = self._metrics(logs)
        step = state.global_step
        if kind == TRAIN:
            if self.last_metrics["train_step"] != step:  # the end's averages share the step
                if state.is_world_process_zero:
                    self.core_context.train.report_training_metrics(step, metrics)
                metrics["train_step"] = step
        elif kind == EVAL:
            if self.last_metrics["eval_step"] != step:
                if state.is_world_process_zero:
                    self.core_context.train.report_validation_metrics(step, metrics)
                metrics["eval_step"] = step
        else:
            log.warning("metrics not reported (kind %s): %s", kind, sorted(metrics))
        self.last_metrics.update(metrics)
        if self.updating_searcher:
            self._update_searcher(state, control)
        if not self.updating_searcher and self.core_context.preempt.should_preempt():
            control.should_save = True  # on_save stores it, then training stops

    def _metrics(self, logs: dict[str, Any]) -> tuple[dict[str, Any], str]:
        kind = get_metric_type(logs)
        if not self.filter_metrics:
            return dict(logs), kind
        kept = {k: v for k, v in logs.items() if any(m in k for m in self.filter_metrics)}
        return kept, kind

    # ---- checkpoints -------------------------------------------------------------------
    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = state.global_step
        folder = os.path.join(str(args.output_dir), f"checkpoint-{step}")
        if state.is_world_process_zero and self.user_data is not None:
            with open(os.path.join(folder, "my_data.json"), "w", encoding="utf-8") as f:
                json.dump(self.user_data, f)
        metadata = {"steps_completed": step, "trial_id": self.info.trial.trial_id}

        def selector(path: str) -> bool:
            return path.startswith((f"checkpoint-{step}/", "runs/"))

        self.core_context.checkpoint.upload(
            args.output_dir, metadata=metadata, shard=True, selector=selector
        )
        if self.core_context.preempt.should_preempt():
            # Determined raised here; stopping the Trainer ends the script the same way
            # without an error (the run ends PAUSED, and activate resumes it).
            log.info("stop requested: checkpoint %d stored, training stops", step)
            control.should_training_stop = True

    def load_last_checkpoint(
        self, args: transformers.TrainingArguments, info: cluster_info.ClusterInfo | None = None
    ) -> None:
        """Download ``latest_checkpoint`` into ``args.output_dir`` and set
        ``args.resume_from_checkpoint`` to its ``checkpoint-N`` folder."""
        info = info or cluster_info.get_cluster_info()
        latest = info.latest_checkpoint if info is not None else None
        if latest is None:
            return
        if getattr(args, "overwrite_output_dir", False) is True:
            log.info("overwrite_output_dir=True: latest checkpoint not downloaded")
            return
        self.core_context.checkpoint.download(latest, args.output_dir)
        args.resume_from_checkpoint = trainer_utils.get_last_checkpoint(args.output_dir)
        log.info("latest checkpoint downloaded to %s", args.resume_from_checkpoint)

    # ---- searcher ----------------------------------------------------------------------
    def on_step_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.current_op is not None and state.epoch and self.searcher_unit == "batches":
            if state.is_world_process_zero:
                self.current_op.report_progress(state.global_step)
            if state.global_step >= self.current_op.length:
                self._update_searcher(state, control)

    def on_epoch_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.current_op is not None and state.epoch and self.searcher_unit == "epochs":
            if state.is_world_process_zero:
                self.current_op.report_progress(state.epoch)
            if state.epoch >= self.current_op.length:
                self._update_searcher(state, control)

    def _update_searcher(
        self, state: transformers.TrainerState, control: transformers.TrainerControl
    ) -> None:
        """Complete the operation with the searcher metric once this step's training and
        evaluation metrics are in; until then ask the Trainer to log, evaluate and save."""
        step = state.global_step
        if not (self.last_metrics["eval_step"] == step and self.last_metrics["train_step"] == step):
            control.should_log = control.should_evaluate = control.should_save = True
            self.updating_searcher = True
            return
        if state.is_world_process_zero:
            value = self.last_metrics.get(self.searcher_metric) if self.searcher_metric else None
            if value is None:
                log.warning(
                    "searcher metric %r is not among the reported metrics %s: reporting the "
                    "Trainer's best_metric",
                    self.searcher_metric,
                    sorted(self.last_metrics),
                )
                value = state.best_metric
            self.current_op.report_completed(value)
        self.updating_searcher = False
        try:
            self.current_op = next(self.searcher_ops)
        except StopIteration:
            control.should_training_stop = True

    def _check_searcher_compatibility(self, args: transformers.TrainingArguments) -> None:
        """The Trainer's length must be the searcher's, in the same unit (Determined's rule:
        --max_steps with max_length.batches, --num_train_epochs with max_length.epochs)."""
        if self.searcher_unit not in ("batches", "epochs"):
            return
        steps = args.max_steps
        trainer = ("batches", steps) if steps != -1 else ("epochs", args.num_train_epochs)
        if trainer != (self.searcher_unit, self.searcher_max_length):
            self._mismatch(*trainer)

    def _mismatch(self, trainer_unit: str, trainer_length: float) -> None:
        raise ValueError(
            f"the Trainer's {trainer_unit}={trainer_length} must match the config's "
            f"searcher.max_length {self.searcher_unit}={self.searcher_max_length}: set "
            "--max_steps with max_length.batches, or --num_train_epochs with "
            "max_length.epochs, to the same value"
        )


def get_metric_type(logs: dict[str, Any]) -> str:
    """The kind of a Trainer log, by its first key: ``eval_``, ``test_``, ``train_`` (the
    end-of-training averages) or training progress."""
    first = next(iter(logs), "")
    for prefix in (EVAL, TEST, TRAIN_AVG):
        if first.startswith(prefix):
            return prefix
    return TRAIN
