"""Training metrics held on the device until a reporting boundary, then read in one go.

Reading a CUDA tensor's value forces a host sync; doing it per batch stalls the GPU
pipeline. So batches only detach their tensors here, and ``materialize`` turns a whole
window of scalars into Python floats with one transfer per device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from det_tasks.errors import TrialError
from det_tasks.pytorch._reducer import to_python

__all__ = ["TrainingMetricsBuffer", "check_metrics", "detach_metrics", "materialize"]


def check_metrics(metrics: Any, method: str) -> dict[str, Any]:
    """A tensor becomes ``{"loss": tensor}``; anything but a str-keyed dict is an error."""
    if isinstance(metrics, torch.Tensor):
        return {"loss": metrics}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TrialError(
            f"{method}() must return a dict of metric names to values (or a loss tensor); "
            f"it returned {type(metrics).__name__}: {str(metrics)[:80]!r}"
        )
    return metrics


def detach_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def materialize(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-batch metric dicts with every value a Python number (or list)."""
    slots: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    out: list[dict[str, Any]] = []
    for i, metrics in enumerate(batches):
        plain: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                slots.setdefault(value.device, []).append((i, key, value))
            else:
                plain[key] = to_python(value)
        out.append(plain)
    for entries in slots.values():
        stacked = torch.stack([t.reshape(()).to(torch.float64) for _, _, t in entries])
        for (i, key, _), number in zip(entries, stacked.tolist()):
            out[i][key] = number
    for i, metrics in enumerate(batches):
        out[i] = {k: out[i][k] for k in metrics}  # keep the user's key order
    return out


class TrainingMetricsBuffer:
    """Per-batch training metrics since the last report, plus record counts."""

    def __init__(self) -> None:
        self._batches: list[dict[str, Any]] = []
        self.num_inputs = 0

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, metrics: dict[str, Any], num_inputs: int) -> None:
        self._batches.append(detach_metrics(metrics))
        self.num_inputs += num_inputs

    def flush(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(mean of each numeric metric over the window, per-batch metrics); then empty."""
        batch_metrics = materialize(self._batches)
        self._batches = []
        self.num_inputs = 0
        keys: list[str] = []
        for m in batch_metrics:
            keys.extend(k for k in m if k not in keys)
        avg: dict[str, float] = {}
        for key in keys:
            values = [m[key] for m in batch_metrics if key in m]
            numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            if len(numeric) == len(values):
                avg[key] = float(np.mean(numeric))
        return avg, batch_metrics
