"""Determined's hyperparameter space as Optuna distributions, and back.

Each searchable leaf becomes one Optuna parameter named by its dotted path
(``optimizer.lr``); constants stay out of the study and are put back when a trial's
values are re-nested into Determined's ``hparams`` shape. ``log`` is ``base ** x`` for x
uniform in [minval, maxval], which is a log-uniform draw over [base**minval,
base**maxval] whatever the base, so it maps onto ``FloatDistribution(log=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from det_tasks.config.hyperparameters import CategoricalHP, ConstHP, DoubleHP, IntHP, LogHP
from det_tasks.errors import ConfigError

__all__ = ["SearchSpace", "search_space"]

_PLAIN = (type(None), bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The study's distributions and what is needed to turn its params into hparams."""

    distributions: dict[str, BaseDistribution]
    constants: dict[str, Any]
    # Categorical leaves whose values Optuna cannot hold (lists, mappings): the study
    # chooses an index into these.
    indexed: dict[str, list[Any]]

    def hparams(self, params: dict[str, Any]) -> dict[str, Any]:
        """A trial's Optuna params as Determined's nested hparams (constants included)."""
        flat = dict(self.constants)
        for name, value in params.items():
            flat[name] = self.indexed[name][value] if name in self.indexed else value
        nested: dict[str, Any] = {}
        for path, value in flat.items():
            node = nested
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return nested

    def numeric(self) -> list[str]:
        return [
            n for n, d in self.distributions.items() if not isinstance(d, CategoricalDistribution)
        ]

    def categorical(self) -> list[str]:
        return [n for n, d in self.distributions.items() if isinstance(d, CategoricalDistribution)]


def search_space(space: dict[str, Any]) -> SearchSpace:
    """Map a parsed ``hyperparameters`` tree onto Optuna distributions."""
    distributions: dict[str, BaseDistribution] = {}
    constants: dict[str, Any] = {}
    indexed: dict[str, list[Any]] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, leaf in node.items():
            path = f"{prefix}{name}"
            if "." in name:
                raise ConfigError(
                    f"hyperparameters.{path}: optuna names parameters by dotted path, so a "
                    "name may not contain '.'; rename it or nest it"
                )
            if isinstance(leaf, dict):
                walk(leaf, f"{path}.")
            elif isinstance(leaf, ConstHP):
                constants[path] = leaf.val
            elif isinstance(leaf, IntHP):
                distributions[path] = IntDistribution(leaf.minval, leaf.maxval)
            elif isinstance(leaf, DoubleHP):
                distributions[path] = FloatDistribution(leaf.minval, leaf.maxval)
            elif isinstance(leaf, LogHP):
                low, high = leaf.base**leaf.minval, leaf.base**leaf.maxval
                distributions[path] = FloatDistribution(min(low, high), max(low, high), log=True)
            elif isinstance(leaf, CategoricalHP):
                if all(isinstance(v, _PLAIN) for v in leaf.vals):
                    distributions[path] = CategoricalDistribution(leaf.vals)
                else:
                    indexed[path] = list(leaf.vals)
                    distributions[path] = CategoricalDistribution(list(range(len(leaf.vals))))

    walk(space, "")
    return SearchSpace(distributions, constants, indexed)
