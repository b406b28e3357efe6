"""Training and validation metrics as TensorBoard scalars, as Determined writes them.

Determined's metric writer logs every per-batch training metric at its batch, averaged
metrics that no batch reported (custom reducers) at the report's batch, and validation
metrics prefixed ``val_`` (unless the name starts with ``val``), each under the tag
``Determined/<name>``, numeric scalars only. The events go to the context's TensorBoard
directory, the one the platform uploads as the trial run's ``tensorboard/`` artifacts;
``init(enable_tensorboard_logging=False)`` turns this off. torch.utils.tensorboard needs
the tensorboard package (in the platform extra); without it this warns once and writes
nothing.
"""

from __future__ import annotations

import importlib.util
import numbers
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["MetricEventWriter", "metric_event_writer"]

_warned_missing = False


def metric_event_writer(context: Any) -> MetricEventWriter | None:
    """The writer for a trial run that has a TensorBoard directory and logging enabled."""
    global _warned_missing
    settings = context._settings
    if not settings.enable_tensorboard_logging or settings.tensorboard_path is None:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        if not _warned_missing:
            _warned_missing = True
            warnings.warn(
                "training and validation metrics are not written to TensorBoard: the "
                "tensorboard package is missing (pip install tensorboard, or the platform "
                "extra); pass enable_tensorboard_logging=False to init() to silence this",
                UserWarning,
                stacklevel=3,
            )
        return None
    return MetricEventWriter(context)


def _scalar(value: Any) -> float | None:
    """Numbers, numpy scalars and 0-d arrays/tensors, as Determined's writer accepts."""
    if isinstance(value, numbers.Real | np.number):
        return float(value)
    if isinstance(value, np.ndarray | torch.Tensor) and value.ndim == 0:
        return float(value.item())
    return None


class MetricEventWriter:
    def __init__(self, context: Any) -> None:
        self._context = context

    def _add(self, name: str, value: Any, step: int) -> None:
        scalar = _scalar(value)
        if scalar is not None:
            self._context.get_tensorboard_writer().add_scalar(f"Determined/{name}", scalar, step)

    def training(
        self, steps_completed: int, avg: dict[str, Any], batch_metrics: list[dict[str, Any]]
    ) -> None:
        seen: set[str] = set()
        for index, batch in enumerate(batch_metrics):
            step = steps_completed - len(batch_metrics) + index
            for name, value in batch.items():
                self._add(name, value, step)
                seen.add(name)
        for name, value in avg.items():
            if name not in seen:
                self._add(name, value, steps_completed)
        self._context.get_tensorboard_writer().flush()

    def validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            self._add(name if name.startswith("val") else f"val_{name}", value, steps_completed)
        self._context.get_tensorboard_writer().flush()
