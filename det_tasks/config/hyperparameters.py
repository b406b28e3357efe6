"""Hyperparameter definitions as Determined's YAML writes them, and sampling one trial's values.

A raw value is a constant; a mapping with a ``type`` key is a searchable parameter; a
mapping without one is a nested group. Leaves are normalised into typed models once.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from det_tasks.config.finite import FINITE_FIX
from det_tasks.config.names import PARAM_KEY_PREFIX, param_key_problem

__all__ = [
    "CategoricalHP",
    "ConstHP",
    "DoubleHP",
    "HParam",
    "IntHP",
    "LogHP",
    "flatten_hparams",
    "grid_size",
    "grid_values",
    "parse_hyperparameters",
    "sample_hparams",
]


class _HP(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ConstHP(_HP):
    type: Literal["const"]
    val: Any


class IntHP(_HP):
    type: Literal["int"]
    minval: int
    maxval: int
    count: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> IntHP:
        if self.minval > self.maxval:
            raise ValueError(f"minval {self.minval} is greater than maxval {self.maxval}")
        return self


class DoubleHP(_HP):
    type: Literal["double"]
    minval: float
    maxval: float
    count: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DoubleHP:
        if not (math.isfinite(self.minval) and math.isfinite(self.maxval)):
            raise ValueError("minval and maxval must be finite numbers")
        if self.minval > self.maxval:
            raise ValueError(f"minval {self.minval} is greater than maxval {self.maxval}")
        return self


class LogHP(_HP):
    """Values are ``base ** x`` for x uniform in [minval, maxval] (Determined's definition).

    Determined's schema (schemas/expconf/v0/hyperparameter-log.json) takes any base > 0.
    A base in (0, 1) is kept: it is still log-uniform, from base**minval down to
    base**maxval. Base 1 is refused: every value would be 1.0."""

    type: Literal["log"]
    minval: float
    maxval: float
    base: float = Field(default=10.0, gt=0)
    count: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LogHP:
        if not (math.isfinite(self.minval) and math.isfinite(self.maxval)):
            raise ValueError("minval and maxval must be finite numbers")
        if not math.isfinite(self.base):
            raise ValueError(f"base must be a finite number, e.g. 10; got {self.base}")
        if self.base == 1:
            raise ValueError(
                "base 1 makes every value 1.0 (values are base ** x for x in [minval, "
                "maxval]): use base 10 (or 2, or e), or type: const for a fixed value"
            )
        if self.minval > self.maxval:
            raise ValueError(f"minval {self.minval} is greater than maxval {self.maxval}")
        return self


class CategoricalHP(_HP):
    type: Literal["categorical"]
    vals: list[Any] = Field(min_length=1)


HParam = Annotated[ConstHP | IntHP | DoubleHP | LogHP | CategoricalHP, Field(discriminator="type")]
_HPARAM = TypeAdapter(HParam)
_MAX_DEPTH = 16


def parse_hyperparameters(
    raw: Any, depth: int = 0, path: str = "hyperparameters"
) -> dict[str, Any]:
    """Normalise a ``hyperparameters:`` mapping into a tree of HP models (raises ValueError)."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a mapping of names to values, got {type(raw).__name__}")
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if not isinstance(name, str):
            raise ValueError(f"hyperparameter names must be strings, got {name!r}")
        if isinstance(value, dict) and "type" in value:
            out[name] = _parse_leaf(value, f"{path}.{name}")
            _check_param_keys(f"{path}.{name}", _values_of(out[name]))
        elif isinstance(value, dict):
            out[name] = parse_hyperparameters(value, depth + 1, f"{path}.{name}")
        else:
            out[name] = ConstHP(type="const", val=value)
            _check_param_keys(f"{path}.{name}", [value])
    return out


def _values_of(leaf: Any) -> list[Any]:
    """The values a leaf can take that may be mappings (flattened into more param keys)."""
    if isinstance(leaf, ConstHP):
        return [leaf.val]
    if isinstance(leaf, CategoricalHP):
        return list(leaf.vals)
    return [None]


def _check_param_keys(path: str, values: list[Any]) -> None:
    """Refuse a name MLflow would refuse as the trial run's param key (``hp.<a.b>``), now,
    rather than when the first trial logs its params. A mapping value is flattened into
    one key per entry, so its keys are checked too."""
    for value in values:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                _check_param_keys(f"{path}.{key}", [inner])
            continue
        key = PARAM_KEY_PREFIX + path.partition(".")[2]
        problem = param_key_problem(key)
        if problem is not None:
            raise ValueError(f"`{path}`: {problem}")


def _parse_leaf(value: dict[str, Any], path: str) -> Any:
    try:
        return _HPARAM.validate_python(value)
    except ValidationError as err:
        problems = []
        for item in err.errors()[:3]:
            loc = ".".join(str(p) for p in item["loc"][1:])
            where = f"{path}.{loc}" if loc else path
            if item["type"] == "finite_number":
                problems.append(f"`{where}` = {item['input']!r} is invalid: {FINITE_FIX}")
            else:
                problems.append(f"`{where}`: {item['msg'].removeprefix('Value error, ')}")
        raise ValueError("; ".join(problems)) from None


def sample_hparams(space: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One random point of the space, as Determined's random searcher draws it."""
    out: dict[str, Any] = {}
    for name, node in space.items():
        if isinstance(node, dict):
            out[name] = sample_hparams(node, rng)
        elif isinstance(node, ConstHP):
            out[name] = node.val
        elif isinstance(node, IntHP):
            out[name] = rng.randint(node.minval, node.maxval)
        elif isinstance(node, DoubleHP):
            out[name] = rng.uniform(node.minval, node.maxval)
        elif isinstance(node, LogHP):
            out[name] = node.base ** rng.uniform(node.minval, node.maxval)
        else:
            out[name] = rng.choice(node.vals)
    return out


def grid_size(node: Any) -> int:
    """How many points ``grid_values(node)`` gives, without making them (a ``count`` of a
    billion must not allocate a billion floats to be refused)."""
    if isinstance(node, ConstHP):
        return 1
    if isinstance(node, CategoricalHP):
        return len(node.vals)
    if node.count is None:
        raise ValueError(f"grid search needs `count` on {node.type} hyperparameters")
    if isinstance(node, IntHP):  # evenly spaced points at least 1 apart round apart
        return min(node.count, node.maxval - node.minval + 1)
    return int(node.count)


def grid_values(node: Any) -> list[Any]:
    """The grid points of one leaf; numeric ranges need ``count``."""
    if isinstance(node, ConstHP):
        return [node.val]
    if isinstance(node, CategoricalHP):
        return list(node.vals)
    if node.count is None:
        raise ValueError(f"grid search needs `count` on {node.type} hyperparameters")
    if isinstance(node, IntHP):
        n = min(node.count, node.maxval - node.minval + 1)
        if n == 1:
            return [node.minval]
        step = (node.maxval - node.minval) / (n - 1)
        return sorted({round(node.minval + i * step) for i in range(n)})
    lo, hi, n = node.minval, node.maxval, node.count
    points = [lo] if n == 1 else [lo + i * (hi - lo) / (n - 1) for i in range(n)]
    if isinstance(node, LogHP):
        return [node.base**p for p in points]
    return points


def flatten_hparams(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the form metric stores and overrides use."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_hparams(value, f"{path}."))
        else:
            flat[path] = value
    return flat
