"""A terminal progress bar as a metrics sink: batches, records/s and the latest metrics."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

__all__ = ["ProgressSink"]


class ProgressSink:
    """Updates a tqdm bar at every training report; prints validations below it."""

    def __init__(self, total_batches: int | None, records_per_batch: int, enabled: bool = True):
        self._bar = tqdm(
            total=total_batches,
            unit="batch",
            dynamic_ncols=True,
            disable=not enabled,
            file=sys.stderr,
        )
        self._records_per_batch = records_per_batch
        self._last_time = time.perf_counter()
        self._last_step = 0
        self._latest: dict[str, str] = {}

    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        batches = steps_completed - self._last_step
        if batches > 0 and now > self._last_time:
            rate = batches * self._records_per_batch / (now - self._last_time)
            self._latest["rec/s"] = f"{rate:,.0f}"
        self._last_time, self._last_step = now, steps_completed
        for key in ("loss",):
            if key in metrics:
                self._latest[key] = f"{metrics[key]:.4f}"
        self._bar.n = steps_completed
        self._bar.set_postfix(self._latest, refresh=True)

    def report_validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        shown = ", ".join(
            f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
        self._bar.write(f"validation @ batch {steps_completed}: {shown}")

    def report_checkpoint(self, steps_completed: int, uuid: str, metadata: dict[str, Any]) -> None:
        self._bar.write(f"checkpoint @ batch {steps_completed}: {uuid}")

    def report_profiling(self, steps_completed: int, timings_ms: dict[str, float]) -> None:
        shown = ", ".join(f"{k}={v:.2f}" for k, v in timings_ms.items())
        self._bar.write(f"profile up to batch {steps_completed}: {shown}")

    def close(self) -> None:
        self._bar.close()
