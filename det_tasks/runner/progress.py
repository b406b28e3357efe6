"""A terminal progress bar as a metrics sink: ``137/500 27% [00:05<00:13, 26.6batch/s,
epoch=1.37, rec/s=1,702, loss=0.4123]``.

The training loop hands the bar a function that reads its batch counter (a host-side int:
no device sync, nothing per step); a thread reads it twice a second, so the bar and its ETA
move between reports too. The loss shown is the last one reported.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

__all__ = ["ProgressSink"]

REFRESH_SECONDS = 0.5


class ProgressSink:
    """A tqdm bar fed by the loop's batch counter; validations and checkpoints print below."""

    def __init__(self, total_batches: int | None, records_per_batch: int, enabled: bool = True):
        self._bar = tqdm(
            total=total_batches,
            unit="batch",
            dynamic_ncols=True,
            disable=not enabled,
            file=sys.stderr,
            mininterval=0,
        )
        self._records_per_batch = records_per_batch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._position: Callable[[], int] | None = None
        self._epoch_len = 0
        self._rate_from = (time.perf_counter(), 0)
        self._postfix: dict[str, str] = {}

    # ---- fed by the loop ----------------------------------------------------------------
    def watch_progress(
        self, position: Callable[[], int], epoch_len: int, max_batches: int | None
    ) -> None:
        """Start following ``position()`` (batches trained so far)."""
        with self._lock:
            self._position, self._epoch_len = position, epoch_len
            if max_batches and not self._bar.total:
                self._bar.total = max_batches
            self._bar.n = self._bar.last_print_n = position()
            self._rate_from = (time.perf_counter(), self._bar.n)
        if self._thread is None and not self._bar.disable:
            self._thread = threading.Thread(target=self._follow, name="progress", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            self.tick()

    def tick(self) -> None:
        """Move the bar to the loop's position (the thread calls this; tests may too)."""
        with self._lock:
            if self._position is None:
                return
            done = self._position()
            now = time.perf_counter()
            since, then = self._rate_from
            if now - since >= 1.0:  # records/s over the last second or more
                rate = (done - then) * self._records_per_batch / (now - since)
                self._postfix["rec/s"] = f"{rate:,.0f}"
                self._rate_from = (now, done)
            if self._epoch_len:
                self._postfix["epoch"] = f"{done / self._epoch_len:.2f}"
            self._bar.set_postfix(self._ordered(), refresh=False)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
            else:
                self._bar.refresh()

    def _ordered(self) -> dict[str, str]:
        return {k: self._postfix[k] for k in ("epoch", "rec/s", "loss") if k in self._postfix}

    # ---- the MetricsSink interface ----------------------------------------------------
    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            if "loss" in metrics:
                self._postfix["loss"] = f"{metrics['loss']:.4f}"
        if self._position is None:  # no loop feeding us (a custom caller): follow reports
            with self._lock:
                self._bar.update(max(steps_completed - self._bar.n, 0))
                self._bar.set_postfix(self._ordered(), refresh=True)
        else:
            self.tick()

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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.tick()
        self._bar.close()
