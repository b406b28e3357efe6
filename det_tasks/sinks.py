"""Where a trial's metrics go: the ``MetricsSink`` interface and in-process implementations.

``registry/`` provides the MLflow sink; the harness only ever sees this interface, and
calls it at reporting boundaries, never per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "InMemoryMetricsSink",
    "MetricsSink",
    "MultiSink",
    "ReportedCheckpoint",
    "record_position_on",
]


@runtime_checkable
class MetricsSink(Protocol):
    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Averaged training metrics of the batches since the last report."""

    def report_validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Reduced validation metrics after ``steps_completed`` batches."""

    def report_checkpoint(self, steps_completed: int, uuid: str, metadata: dict[str, Any]) -> None:
        """A checkpoint was published."""

    def report_profiling(self, steps_completed: int, timings_ms: dict[str, float]) -> None:
        """Mean phase timings over a profiling window."""

    def close(self) -> None:
        """Flush anything buffered."""


@dataclasses.dataclass
class ReportedCheckpoint:
    steps_completed: int
    uuid: str
    metadata: dict[str, Any]


class InMemoryMetricsSink:
    """Keeps every report in lists: for tests, local runs and the Trainer API's return."""

    def __init__(self) -> None:
        self.training: list[tuple[int, dict[str, Any]]] = []
        self.validation: list[tuple[int, dict[str, Any]]] = []
        self.checkpoints: list[ReportedCheckpoint] = []
        self.profiling: list[tuple[int, dict[str, float]]] = []
        self.groups: list[tuple[str, int, dict[str, Any]]] = []

    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.training.append((steps_completed, dict(metrics)))

    def report_validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.validation.append((steps_completed, dict(metrics)))

    def report_checkpoint(self, steps_completed: int, uuid: str, metadata: dict[str, Any]) -> None:
        self.checkpoints.append(ReportedCheckpoint(steps_completed, uuid, dict(metadata)))

    def report_profiling(self, steps_completed: int, timings_ms: dict[str, float]) -> None:
        self.profiling.append((steps_completed, dict(timings_ms)))

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Optional on sinks: metrics of another group than training/validation (the
        platform's own counters, kept out of the user's metrics)."""
        self.groups.append((group, steps_completed, dict(metrics)))

    def close(self) -> None:
        """Nothing is buffered."""


class MultiSink:
    """Fans every report out to several sinks, in order."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = list(sinks)

    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.report_training(steps_completed, metrics)

    def report_validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.report_validation(steps_completed, metrics)

    def report_checkpoint(self, steps_completed: int, uuid: str, metadata: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.report_checkpoint(steps_completed, uuid, metadata)

    def report_profiling(self, steps_completed: int, timings_ms: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.report_profiling(steps_completed, timings_ms)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Optional on sinks: a group of metrics other than training/validation."""
        for sink in self.sinks:
            report = getattr(sink, "report_metrics", None)
            if report is not None:
                report(group, steps_completed, metrics)

    def report_progress(self, steps_completed: int, epochs: float) -> None:
        """Optional on sinks: batches and epochs trained, at each training report."""
        for sink in self.sinks:
            progress = getattr(sink, "report_progress", None)
            if progress is not None:
                progress(steps_completed, epochs)

    def watch_progress(
        self, position: Callable[[], int], epoch_len: int, max_batches: int | None
    ) -> None:
        """Optional on sinks: follow the loop's batch counter (a progress bar's clock)."""
        for sink in self.sinks:
            watch = getattr(sink, "watch_progress", None)
            if watch is not None:
                watch(position, epoch_len, max_batches)

    def record_position(self, trained: int, length: int | None, stop_requested: bool) -> None:
        """Optional on sinks: where the loop stands (record_position_on)."""
        for sink in self.sinks:
            record_position_on(sink, trained, length, stop_requested)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def record_position_on(sink: Any, trained: int, length: int | None, stop_requested: bool) -> None:
    """Tell ``sink`` (if it keeps it: the platform's sink does) how far the trial got:
    ``trained`` batches of its searcher ``length``, and whether it asked to stop early.
    Told when a trial starts and after every stretch of training, so whoever ends the
    trial's run knows whether it may be recorded COMPLETED."""
    record = getattr(sink, "record_position", None)
    if record is not None:
        record(trained, length, stop_requested)
