"""Metric reduction: the ``Reducer`` enum, ``MetricReducer`` and the function-reducer form.

A metric computed on N slots must equal the metric computed on one process over the same
data, so every reduction goes per-slot first and cross-slot second.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from det_tasks.errors import TrialError

__all__ = [
    "FunctionReducer",
    "MetricReducer",
    "Reducer",
    "as_metric_reducer",
    "reduce_batch_metrics",
    "to_python",
]


class Reducer(enum.Enum):
    """How per-batch validation metrics combine: AVG (mean of batches), SUM, MAX, MIN."""

    AVG = 1
    SUM = 2
    MAX = 3
    MIN = 4


class MetricReducer(abc.ABC):
    """A custom reducer: gather values, reduce per slot, then across slots."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget values; called before every training or validation workload."""

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any:
        """A picklable summary of this slot's values."""

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        """Combine every slot's summary into the final metric (or dict of metrics)."""


class FunctionReducer(MetricReducer):
    """Adapts a ``fn(values: list) -> metric`` into a MetricReducer with ``update()``."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self._fn = fn
        self._values: list[Any] = []

    def update(self, value: Any) -> None:
        self._values.append(value)

    def reset(self) -> None:
        self._values = []

    def per_slot_reduce(self) -> Any:
        return self._values

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        flat = [v for slot in per_slot_metrics for v in slot]
        return self._fn(flat)


def as_metric_reducer(reducer: Callable[[list[Any]], Any] | MetricReducer) -> MetricReducer:
    """What ``wrap_reducer`` takes, as a MetricReducer: a function is adapted; anything else
    is refused in one line."""
    if isinstance(reducer, MetricReducer):
        return reducer
    if not callable(reducer):
        raise TypeError(f"wrap_reducer takes a function or a MetricReducer, got {reducer!r}")
    return FunctionReducer(reducer)


def to_python(value: Any) -> Any:
    """Tensors and numpy values become plain Python numbers or lists, inside lists, tuples
    and dicts too, so a metric survives a JSON round trip (checkpoint metadata) as the
    same float, NaN and infinity included, rather than as its ``str()``."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    return value


def _simple_reduce(reducer: Reducer, values: Any, weights: list[int] | None = None) -> Any:
    """Determined's reduction of stacked values, in their own dtype: float32 metrics reduce
    in float32 and come back as ``np.float32`` (what its callbacks receive)."""
    if reducer is Reducer.AVG:
        return np.average(values, weights=weights)
    if reducer is Reducer.SUM:
        return np.sum(values)
    if reducer is Reducer.MAX:
        return np.max(values)
    return np.min(values)


def _reduce_slots(reducer: Reducer, slot_values: list[list[Any]]) -> Any:
    """Per slot over its stacked batches, then across the slots that had any (an average
    weighted by their batch counts), as Determined's ``_reduce_metrics`` does."""
    per_slot = [(_simple_reduce(reducer, np.stack(v)), len(v)) for v in slot_values if v]
    if not per_slot:
        return math.nan
    if len(per_slot) == 1:
        return per_slot[0][0]
    values, counts = zip(*per_slot, strict=True)
    return _simple_reduce(reducer, list(values), weights=list(counts))


def reduce_batch_metrics(
    reducers: Reducer | dict[str, Reducer],
    per_slot_batches: list[list[dict[str, Any]]],
) -> dict[str, Any]:
    """Reduce every slot's list of per-batch metric dicts into one dict of numpy scalars.

    Each slot reduces its own batches, then the slots' results combine (AVG weighted by
    each slot's batch count), as in Determined; one slot gives the single-process answer.
    """
    keys: list[str] = []
    for batches in per_slot_batches:
        for metrics in batches:
            keys.extend(k for k in metrics if k not in keys)
    out: dict[str, Any] = {}
    for key in keys:
        if isinstance(reducers, dict):
            if key not in reducers:
                raise TrialError(
                    f"evaluation_reducer() returned a dict without metric {key!r}; "
                    f"add it (e.g. {key!r}: Reducer.AVG) or return one Reducer for all"
                )
            reducer = reducers[key]
        else:
            reducer = reducers
        if not isinstance(reducer, Reducer):
            raise TrialError(
                f"evaluation_reducer() gave {reducer!r} for {key!r}; use a pytorch.Reducer "
                "(AVG, SUM, MAX, MIN) or context.experimental.wrap_reducer for custom ones"
            )
        values = [
            [_scalar(key, m[key]) for m in batches if key in m] for batches in per_slot_batches
        ]
        out[key] = _reduce_slots(reducer, values)
    return out


def _scalar(key: str, value: Any) -> Any:
    """The value itself (a number, numpy scalar or 0-d array), refused unless it is one
    number: per-batch validation metrics reduce to one value each."""
    plain = to_python(value)
    if isinstance(plain, bool) or not isinstance(plain, int | float):
        raise TrialError(
            f"metric {key!r} is {plain!r}: per-batch metrics must be scalars (a number or a "
            "one-element tensor); reduce it yourself or use context.experimental.wrap_reducer"
        )
    return value
