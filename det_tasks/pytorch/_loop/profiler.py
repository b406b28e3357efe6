"""Determined's profiler: mean time per phase over a window of batches, plus the system
figures Determined's ``fit(profiling_enabled=True)`` collects (CPU utilisation and memory
over the window, peak GPU memory), reported together when the window closes.

Off by default and then free (one branch per phase). With ``sync_timings`` CUDA work
is waited for, so GPU time lands in the phase that launched it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch

__all__ = ["PhaseTimer", "ProfilerSettings"]

_UNTIMED = contextlib.nullcontext()  # reusable: entering it costs two attribute lookups


@dataclasses.dataclass(frozen=True)
class ProfilerSettings:
    enabled: bool = False
    begin_on_batch: int = 0
    end_after_batch: int | None = None
    sync_timings: bool = True

    def __post_init__(self) -> None:
        if self.begin_on_batch < 0:
            raise ValueError(f"begin_on_batch must be >= 0, got {self.begin_on_batch}")
        if self.end_after_batch is not None and self.end_after_batch < self.begin_on_batch:
            raise ValueError(
                f"end_after_batch ({self.end_after_batch}) is before begin_on_batch "
                f"({self.begin_on_batch})"
            )


class PhaseTimer:
    """Accumulates phase timings for batches in the profiling window."""

    def __init__(self, settings: ProfilerSettings | None, device: torch.device) -> None:
        self.settings = settings if settings and settings.enabled else None
        self._sync = bool(self.settings and self.settings.sync_timings and device.type == "cuda")
        self._device = device
        self._totals: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._reported = False
        if self.settings is not None:
            psutil.cpu_percent(interval=None)  # starts the utilisation window

    def _active(self, batch_idx: int) -> bool:
        s = self.settings
        if s is None or batch_idx < s.begin_on_batch:
            return False
        return s.end_after_batch is None or batch_idx <= s.end_after_batch

    def phase(self, batch_idx: int, name: str) -> contextlib.AbstractContextManager[None]:
        """Times the block when profiling covers this batch; otherwise a shared no-op."""
        if self.settings is None or not self._active(batch_idx):
            return _UNTIMED
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize(self._device)
        start = time.perf_counter()
        yield
        if self._sync:
            torch.cuda.synchronize(self._device)
        self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start
        self._counts[name] = self._counts.get(name, 0) + 1

    def maybe_report(self, batches_done: int, sink: Any) -> None:
        """Report once, right after the window's last batch."""
        s = self.settings
        if s is None or s.end_after_batch is None or batches_done <= s.end_after_batch:
            return
        self.flush(batches_done, sink)

    def flush(self, batches_done: int, sink: Any) -> None:
        """Report what the window collected, if not yet reported (end of training)."""
        if self.settings is None or self._reported or not self._totals:
            return
        self._reported = True
        means = {f"{k}_ms": 1000 * self._totals[k] / self._counts[k] for k in self._totals}
        means.update(system_metrics(self._device))
        if sink is not None:
            sink.report_profiling(batches_done, means)


def system_metrics(device: torch.device) -> dict[str, float]:
    """CPU utilisation since the window began, memory in use, and peak GPU memory."""
    memory = psutil.virtual_memory()
    figures = {
        "cpu_util_percent": float(psutil.cpu_percent(interval=None)),
        "memory_used_gb": (memory.total - memory.available) / 2**30,
        "process_rss_gb": psutil.Process().memory_info().rss / 2**30,
    }
    if device.type == "cuda":
        figures["gpu_max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return figures
