"""``core.TrainContext``: training, validation and other metrics of a Core API script, sent
where a ``PyTorchTrial``'s go (the trial's MLflow run on the platform, memory and the log
locally), with the same step and progress bookkeeping."""

from __future__ import annotations

import enum
import logging
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

from det_tasks.core._tensorboard import ScalarWriter
from det_tasks.distributed import DistributedContext
from det_tasks.run_services import TrialControl
from det_tasks.sinks import MetricsSink

__all__ = ["EarlyExitReason", "TensorboardMode", "TrainContext"]

log = logging.getLogger("determined.core")


class EarlyExitReason(enum.Enum):
    """Why a trial ended before its length: its hyperparameters are invalid (the searcher
    drops it), or it chose to stop (a normal end)."""

    INVALID_HP = "EXITED_REASON_INVALID_HP"
    USER_REQUESTED_STOP = "EXITED_REASON_USER_REQUESTED_STOP"


class TensorboardMode(enum.Enum):
    """``AUTO``: the platform keeps the TensorBoard folder; ``MANUAL``: the script writes
    its own files there and calls ``upload_tensorboard_files()``."""

    AUTO = "AUTO"
    MANUAL = "MANUAL"


class TrainContext:
    """Reports of one trial: every report also tells the runner how far the trial got."""

    def __init__(
        self,
        sink: MetricsSink,
        control: TrialControl,
        dist: DistributedContext,
        tensorboard_path: Path,
        tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
        searcher: dict[str, Any] | None = None,
        events: ScalarWriter | None = None,
    ) -> None:
        self._sink = sink
        self._control = control
        self._dist = dist
        self._tb_path = tensorboard_path
        self._tensorboard_mode = TensorboardMode(tensorboard_mode)
        self._metric = (searcher or {}).get("metric")
        self._smaller_is_better = bool((searcher or {}).get("smaller_is_better", True))
        self._best: float | None = None
        self._events = events  # AUTO mode on the platform: the reports as scalars too
        self.last_validation: tuple[int, dict[str, Any]] | None = None
        self.status: str | None = None

    def report_training_metrics(
        self,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
        epochs: float | None = None,
    ) -> None:
        """Averaged training metrics after ``steps_completed`` batches (``batch_metrics``
        are accepted and logged at DEBUG, as Determined keeps them out of its UI)."""
        steps = _steps("report_training_metrics", steps_completed)
        _check_metrics("report_training_metrics", metrics)
        log.info("report_training_metrics(steps_completed=%d, metrics=%s)", steps, metrics)
        if batch_metrics is not None:
            log.debug("batch_metrics at %d: %s", steps, batch_metrics)
        self._sink.report_training(steps, metrics)
        if self._events is not None:
            self._events.training(steps, metrics, batch_metrics)
        progress = getattr(self._sink, "report_progress", None)
        if progress is not None:
            progress(steps, float(epochs) if epochs is not None else 0.0)
        self._control.reached(steps)

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Validation metrics after ``steps_completed`` batches; the searcher reads its
        metric (``searcher.metric``) from them."""
        steps = _steps("report_validation_metrics", steps_completed)
        _check_metrics("report_validation_metrics", metrics)
        for name, value in metrics.items():
            if value is None:
                raise RuntimeError(f"validation metric {name!r} has no value (None)")
        kept = {k: v for k, v in metrics.items() if not isinstance(v, bytes | bytearray)}
        if len(kept) < len(metrics):
            log.warning("removed non-serializable metrics: %s", sorted(set(metrics) - set(kept)))
        log.info("report_validation_metrics(steps_completed=%d, metrics=%s)", steps, kept)
        self._sink.report_validation(steps, kept)
        if self._events is not None:
            self._events.validation(steps, kept)
        self.last_validation = (steps, dict(kept))
        self._note_best(kept)
        self._control.reached(steps)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Metrics of any group: ``training`` and ``validation`` as their own methods,
        others as ``group/name`` in the trial's run."""
        if group == "training":
            self.report_training_metrics(steps_completed, metrics)
            return
        if group == "validation":
            self.report_validation_metrics(steps_completed, metrics)
            return
        if not isinstance(group, str) or not group or "/" in group:
            raise ValueError(f"report_metrics: group must be a name without '/', got {group!r}")
        steps = _steps("report_metrics", steps_completed)
        _check_metrics("report_metrics", metrics)
        report = getattr(self._sink, "report_metrics", None)
        if report is None:
            raise TypeError(
                f"report_metrics: the metrics sink {type(self._sink).__name__} keeps only "
                "training and validation metrics; report those groups"
            )
        report(group, steps, metrics)

    def report_progress(self, progress: float) -> None:
        """The fraction (0 to 1) of its training the trial has done, as ``progress/fraction``
        at the last reported batch."""
        if not isinstance(progress, numbers.Real) or not 0 <= float(progress) <= 1:
            raise ValueError(f"report_progress takes a fraction from 0 to 1, got {progress!r}")
        report = getattr(self._sink, "report_metrics", None)
        if report is not None:
            report("progress", self._control.steps_completed, {"fraction": float(progress)})
        log.info("report_progress(%s)", progress)

    def report_early_exit(self, reason: EarlyExitReason) -> None:
        """The trial stops before its length: ``INVALID_HP`` makes the searcher drop it;
        ``USER_REQUESTED_STOP`` ends it as a normal, complete trial."""
        reason = EarlyExitReason(reason)
        if self._control.early_exit is not None:
            log.warning("early exit already reported for this trial; ignoring %s", reason)
            return
        log.info("report_early_exit(%s)", reason)
        self._control.early_exit = reason.value

    def get_experiment_best_validation(self) -> float | None:
        """The best ``searcher.metric`` value reported so far: the experiment's best when
        this trial's segment started (a search passes it on), or this trial's own since,
        whichever is better; None before any."""
        return self._best

    def set_experiment_best(self, value: float | None) -> None:
        """What the platform knows of the other trials' best (cluster info)."""
        if value is not None:
            self._best = self._better(float(value), self._best)

    def get_tensorboard_path(self) -> Path:
        """The folder whose TensorBoard files the platform keeps with the trial's run."""
        return self._tb_path

    def upload_tensorboard_files(
        self,
        selector: Callable[[Path], bool] | None = None,
        mangler: Callable[[Path, int], Path] | None = None,
    ) -> None:
        """``MANUAL`` mode only, as in Determined: the files under ``get_tensorboard_path()``
        are stored with the trial's run when it ends (the platform uploads the folder)."""
        if self._tensorboard_mode == TensorboardMode.AUTO:
            raise RuntimeError("upload_tensorboard_files can only be used in MANUAL mode")
        if selector is not None or mangler is not None:
            raise NotImplementedError(
                "upload_tensorboard_files(selector=, mangler=) is not supported by det_tasks: "
                "every file under get_tensorboard_path() is stored with the run; write only "
                "the files you want kept there"
            )
        log.info("TensorBoard files in %s are stored with the run when it ends", self._tb_path)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    def set_status(self, status: str) -> None:
        """A short note of what the trial is doing (logged; kept as ``.status``)."""
        self.status = str(status)
        log.info("status: %s", status)

    def _note_best(self, metrics: dict[str, Any]) -> None:
        value = metrics.get(self._metric) if self._metric else None
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            self._best = self._better(float(value), self._best)

    def _better(self, value: float, best: float | None) -> float:
        if best is None:
            return value
        return min(value, best) if self._smaller_is_better else max(value, best)


def _steps(where: str, steps_completed: Any) -> int:
    if type(steps_completed) is int and steps_completed >= 0:  # the usual case, cheaply
        return steps_completed
    if isinstance(steps_completed, bool) or not isinstance(steps_completed, numbers.Integral):
        raise TypeError(f"{where}: steps_completed must be an int, got {steps_completed!r}")
    if steps_completed < 0:
        raise ValueError(f"{where}: steps_completed must be >= 0, got {steps_completed}")
    return int(steps_completed)


def _check_metrics(where: str, metrics: Any) -> None:
    if not isinstance(metrics, dict):
        raise TypeError(f"{where}: metrics must be a dict of names to values, got {metrics!r}")
