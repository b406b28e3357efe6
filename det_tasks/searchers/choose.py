"""The searcher a config names: a built-in one (single, grid, random, adaptive_asha) or a
plug-in's, with its trials fixed by ``reproducibility.experiment_seed``."""

from __future__ import annotations

import itertools
import random
from typing import Any

from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.grid import grid_leaves, grid_problem, grid_trial_count
from det_tasks.config.hyperparameters import grid_values, sample_hparams
from det_tasks.config.searcher_plugins import (
    BUILT_IN_SEARCHERS,
    find_searcher_plugin,
    missing_package,
)
from det_tasks.errors import ConfigError
from det_tasks.searchers.asha import AshaSearcher
from det_tasks.searchers.base import Searcher
from det_tasks.searchers.random_search import RandomSearcher

__all__ = ["make_searcher", "trials_at_once"]


def _grid(space: dict[str, Any], max_trials: int | None = None) -> list[dict[str, Any]]:
    """The grid's first ``max_trials`` points (all without it), refused past the limit
    (``det_tasks.config.grid``) before any point is made."""
    try:
        grid_trial_count(space)  # names a range without `count`
        problem = grid_problem(space, max_trials)
        leaves = [(path, grid_values(leaf)) for path, leaf in grid_leaves(space)]
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if problem is not None:
        raise ConfigError(problem)
    trials = []
    combos = itertools.product(*(values for _, values in leaves))
    for combo in itertools.islice(combos, max_trials):
        hp: dict[str, Any] = {}
        for (path, _), value in zip(leaves, combo):
            node = hp
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        trials.append(hp)
    return trials


def make_searcher(config: ExperimentConfig, max_batches: int | None = None) -> Searcher:
    """The searcher the config names, with trials fixed by experiment_seed.

    ``max_batches`` None trains single/grid/random trials to the config's max_length
    (epochs included); ASHA needs its length in batches to place its rungs.
    """
    s, seed = config.searcher, config.reproducibility.experiment_seed
    space = config.hyperparameters
    if s.name == "single":
        return Searcher([sample_hparams(space, random.Random(seed))], max_batches)
    if s.name == "grid":
        return Searcher(_grid(space, s.max_trials), max_batches)
    if s.name == "random":
        assert s.max_trials is not None
        return RandomSearcher(space, seed, s.max_trials, max_batches)
    if s.name == "adaptive_asha":
        assert s.max_trials is not None
        if max_batches is None:
            max_batches = config.max_length_in_batches()
        if max_batches is None:  # refused when the config was read; kept for a bypass
            raise ConfigError(
                "adaptive_asha needs its length in batches to place rungs: add "
                "records_per_epoch, or give max_length in batches or records"
            )
        return AshaSearcher(
            space,
            seed,
            max_batches,
            s.max_trials,
            s.divisor,
            s.max_rungs,
            s.smaller_is_better,
            stop_once=s.stop_once,
            mode=s.mode,
            bracket_rungs=s.bracket_rungs,
        )
    if s.name not in BUILT_IN_SEARCHERS:
        return _plugin_searcher(config, max_batches)
    raise ConfigError(
        f"searcher.name {s.name!r} is not supported by det-tasks flows; use "
        "single, grid, random, adaptive_asha or a plug-in searcher (optuna)"
    )


def _plugin_searcher(config: ExperimentConfig, max_batches: int | None) -> Searcher:
    """The searcher a ``det_tasks.searchers`` plug-in builds (det_tasks.config.searcher_plugins)."""
    name = config.searcher.name
    try:
        searcher = find_searcher_plugin(name).make(config, max_batches)
    except ImportError as err:  # a plug-in importing its library only now
        raise missing_package(name, err) from None
    if not isinstance(searcher, Searcher):
        raise TypeError(f"the {name!r} searcher plugin returned {type(searcher).__name__}")
    return searcher


def trials_at_once(config: ExperimentConfig) -> int:
    """How many trials an experiment runs at once: its concurrency limit, or fewer when its
    searcher cannot start that many (1 for ``single``). The flow sizes its workers by it,
    and ``det experiment create`` queues that many trials."""
    limit = max(1, config.searcher.max_concurrent_trials or 1)
    return max(1, min(limit, len(make_searcher(config).start())))
