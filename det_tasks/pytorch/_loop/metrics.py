"""Training metrics held on the device until a reporting boundary, then read in one go.

Reading a CUDA tensor's value forces a host sync; doing it per batch stalls the GPU
pipeline. So batches only detach their tensors here, and ``materialize`` turns a whole
window of scalars into Python floats with one transfer per device.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

from det_tasks.errors import TrialError
from det_tasks.pytorch._api.reducer import to_python

__all__ = [
    "TrainingMetricsBuffer",
    "as_numpy",
    "average_across_ranks",
    "average_metric",
    "check_metrics",
    "detach_metrics",
    "materialize",
    "numpy_batches",
]

log = logging.getLogger(__name__)


def check_metrics(metrics: Any, method: str) -> dict[str, Any]:
    """A tensor becomes ``{"loss": tensor}``; anything but a str-keyed dict is an error."""
    if isinstance(metrics, torch.Tensor):
        return {"loss": metrics}
    if isinstance(metrics, dict):
        for key in metrics:  # a loop, not all(<generator>): this runs once per batch
            if not isinstance(key, str):
                break
        else:
            return metrics
    raise TrialError(
        f"{method}() must return a dict of metric names to values (or a loss tensor); "
        f"it returned {type(metrics).__name__}: {str(metrics)[:80]!r}"
    )


def detach_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def materialize(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-batch metric dicts with every value a Python number (or list)."""
    slots: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    out: list[dict[str, Any]] = []
    for i, metrics in enumerate(batches):
        plain: dict[str, Any] = {}
        for key, value in metrics.items():
            if type(value) is float:  # a CPU scalar the buffer already read: as it is
                plain[key] = value
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                slots.setdefault(value.device, []).append((i, key, value))
            else:
                plain[key] = to_python(value)
        out.append(plain)
    if not slots:  # no tensor was set aside, so every dict already has the user's key order
        return out
    for entries in slots.values():
        stacked = torch.stack([t.reshape(()).to(torch.float64) for _, _, t in entries])
        for (i, key, _), number in zip(entries, stacked.tolist()):
            out[i][key] = number
    for i, metrics in enumerate(batches):
        out[i] = {k: out[i][k] for k in metrics}  # keep the user's key order
    return out


def numpy_batches(
    batches: list[dict[str, Any]], plain: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per-batch metrics as Determined hands them to callbacks: each tensor as the numpy
    array ``tensor.cpu().numpy()`` gives (its dtype and shape), built from ``materialize``'s
    numbers (float64 holds every float32/float16 value exactly) so no second transfer;
    other values as the trial returned them."""
    return [
        {
            key: _numpy_like(value, numbers[key]) if isinstance(value, torch.Tensor) else value
            for key, value in metrics.items()
        }
        for metrics, numbers in zip(batches, plain, strict=True)
    ]


def as_numpy(value: Any) -> Any:
    """A tensor as Determined's ``_convert_metrics_to_numpy`` leaves it (a numpy array);
    anything else unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def _numpy_like(tensor: torch.Tensor, number: Any) -> np.ndarray:
    return np.asarray(number, dtype=_numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape))


@functools.lru_cache(maxsize=32)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for a torch dtype; bfloat16, which numpy lacks, as float32."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return np.dtype(np.float32)


def _held(value: Any) -> Any:
    """A training metric as the buffer keeps it: a one-element CPU tensor becomes its float
    at once (one op and no sync, cheaper than detaching it now and converting it later;
    the same number ``materialize`` gives), other tensors are detached and stay put."""
    if isinstance(value, torch.Tensor):
        if value.is_cpu and value.numel() == 1 and not value.is_complex():
            return float(value.item())
        return value.detach()
    return value


class TrainingMetricsBuffer:
    """Per-batch training metrics since the last report."""

    def __init__(self) -> None:
        self._batches: list[dict[str, Any]] = []
        self._unaveraged: set[str] = set()
        self.count = 0  # batches held: an attribute, read by the loop once per batch

    def __len__(self) -> int:
        return self.count

    def add(self, metrics: dict[str, Any]) -> None:
        self._batches.append({key: _held(value) for key, value in metrics.items()})
        self.count += 1

    def flush(self) -> tuple[dict[str, float | None], list[dict[str, Any]]]:
        """(Determined's average of each metric over the window, per-batch metrics); then
        empty. A metric that cannot be averaged keeps its key with the value None."""
        batch_metrics = materialize(self._batches)
        self._batches = []
        self.count = 0
        keys = list(dict.fromkeys(k for m in batch_metrics for k in m))  # first-seen order
        avg = {key: average_metric([m.get(key) for m in batch_metrics]) for key in keys}
        for key in keys:
            if avg[key] is None and key not in self._unaveraged:
                self._unaveraged.add(key)
                log.warning(
                    "training metric %r cannot be averaged (%r...): it is reported as None, "
                    "as Determined does, and reaches on_training_workload_end per batch",
                    key, str(batch_metrics[0].get(key))[:40],
                )  # fmt: skip
        return avg, batch_metrics


def average_metric(values: list[Any]) -> float | None:
    """Determined's training-metric average: the mean of every element of every batch's
    value (scalars, bools, and same-shaped tensors or arrays alike), Nones left out; None
    when the values cannot be averaged (strings, ragged shapes)."""
    try:
        array = np.array(values)
        kept = array[array != None]  # noqa: E711 - elementwise, as Determined filters
        if kept.size == 0:
            return None
        return float(np.mean(kept.astype(np.float64)))
    except (TypeError, ValueError):
        return None


def average_across_ranks(everyone: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each metric's mean over the ranks that could average it."""
    out: dict[str, float | None] = {}
    for key in everyone[0]:
        values = [m[key] for m in everyone if m.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    return out
