"""How many trials a grid search makes, counted before any is made, and its limit.

A grid is the product of every hyperparameter's values, so a few ``count``s multiply into
more trials than anyone meant to run (three of ``count: 22`` are 10,648 trials). Past
``MAX_GRID_TRIALS`` the config is refused unless ``searcher.max_trials`` says how many
trials to run: a grid runs its first ``max_trials`` points.
"""

from __future__ import annotations

import math
from typing import Any

from det_tasks.config.hyperparameters import grid_size

__all__ = ["MAX_GRID_TRIALS", "grid_leaves", "grid_problem", "grid_trial_count"]

# The largest experiment measured on the stack (1,024 trials, docs FACTS of 2026-11-26).
MAX_GRID_TRIALS = 1024


def grid_leaves(
    space: dict[str, Any], path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any]]:
    """(path of names, leaf) of every hyperparameter, in the order the grid varies them."""
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for name, node in space.items():
        if isinstance(node, dict):
            leaves += grid_leaves(node, (*path, name))
        else:
            leaves.append(((*path, name), node))
    return leaves


def grid_trial_count(space: dict[str, Any]) -> int:
    """The number of points of the grid (raises ValueError naming a leaf without count)."""
    sizes = []
    for path, leaf in grid_leaves(space):
        try:
            sizes.append(grid_size(leaf))
        except ValueError as err:
            raise ValueError(f"`hyperparameters.{'.'.join(path)}`: {err}") from None
    return math.prod(sizes)


def grid_problem(space: dict[str, Any], max_trials: int | None) -> str | None:
    """Why the grid is refused (too many trials to run unasked, or one value list so long
    that making it is the harm), or None. A range without ``count`` is not counted here:
    the searcher refuses it, naming it, when the grid is made."""
    try:
        total = grid_trial_count(space)
    except ValueError:
        return None
    allowed = max(MAX_GRID_TRIALS, max_trials or 0)
    for path, leaf in grid_leaves(space):
        size = grid_size(leaf)
        if size > allowed:
            return (
                f"`hyperparameters.{'.'.join(path)}` has {size:,} grid values, more than the "
                f"{allowed:,} trials this grid may run: lower its count"
            )
    if max_trials is None and total > MAX_GRID_TRIALS:
        return (
            f"the grid search makes {total:,} trials, over the {MAX_GRID_TRIALS:,} a grid "
            "runs unless asked: give fewer values (count, vals), or set "
            f"`searcher.max_trials: {total}` to run them all (max_trials: N runs the first N)"
        )
    return None
