"""Refusing NaN and infinity anywhere in a config, with the field's path.

Determined's master stores a config as JSON, which has no NaN or infinity, so no value of
its configs is ever one. Here YAML's ``.nan`` / ``.inf`` (and pydantic reading the string
``"inf"`` as a float) would otherwise reach the job queue's shares, a searcher's bounds or
a trial's hyperparameters, where they break arithmetic far from the file that set them.
Typed float fields refuse them through pydantic (``allow_inf_nan=False`` on each model);
this walk covers the free-form parts too: constant and categorical hyperparameters,
``data:``, ``environment:``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FINITE_FIX", "non_finite_field"]

FINITE_FIX = "give a finite number (NaN and infinity are not accepted in a config)"


def non_finite_field(raw: Any, path: str = "") -> tuple[str, float] | None:
    """The dotted path and value of the first NaN or infinite float in ``raw``, or None."""
    stack: list[tuple[str, Any]] = [(path, raw)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return where or "(top level)", node
        if isinstance(node, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in node.items()]
            stack.extend(reversed(items))
        elif isinstance(node, list):
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(node)]))
    return None
