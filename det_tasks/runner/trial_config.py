"""The experiment config a trial sees (``context.get_experiment_config()``).

Determined's master fills in every default before a trial starts, so trial code reads
fields the YAML never set: ``config["resources"]["slots_per_trial"]``,
``config["searcher"]["smaller_is_better"]`` (Determined's own EfficientDet example does).
The trial gets the user's mapping with the validated config's defaults under it: what the
user wrote wins, hyperparameters stay as written, and nothing unset is invented as None.
"""

from __future__ import annotations

import copy
from typing import Any

from det_tasks.config import ExperimentConfig

__all__ = ["with_defaults"]


def with_defaults(raw: dict[str, Any], config: ExperimentConfig) -> dict[str, Any]:
    """``raw`` (overrides applied) over ``config``'s defaults, as a new mapping."""
    defaults = config.model_dump(mode="json", exclude_none=True)
    defaults.pop("hyperparameters", None)  # the user's form, not the parsed one
    return _merge(defaults, raw)


def _merge(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(given)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merge(value, out[key])
    return out
