"""The ``optuna`` searcher plug-in: its own ``searcher.*`` fields and rules, checked when the
config is read, and its searcher (``det_tasks.searchers.optuna.search``, which imports Optuna) built
only when an experiment runs, so reading a config never imports Optuna."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from det_tasks.config.searcher_plugins import SearcherOptions, SearcherPlugin

if TYPE_CHECKING:
    from det_tasks.config import ExperimentConfig
    from det_tasks.config.experiment import SearcherConfig
    from det_tasks.searchers.base import Searcher

__all__ = ["PLUGIN", "OptunaOptions"]

# Fields of the shared searcher section that belong to adaptive_asha's brackets.
_ASHA_ONLY = ("mode", "bracket_rungs", "stop_once")


class OptunaOptions(SearcherOptions):
    """``searcher.sampler`` and ``searcher.pruner``; the pruner validates at ASHA's rung
    lengths, from max_length, divisor and max_rungs."""

    sampler: Literal["tpe", "cmaes", "gp", "random", "qmc"] = "tpe"
    pruner: Literal["none", "asha", "hyperband", "median"] = "asha"


def _check(searcher: SearcherConfig) -> None:
    if searcher.max_trials is None:
        raise ValueError("the optuna searcher needs max_trials, e.g. max_trials: 16")
    if (searcher.time_metric is None) != (searcher.max_time is None):
        raise ValueError("optuna needs both time_metric and max_time, or neither")
    for field in (f for f in _ASHA_ONLY if f in searcher.model_fields_set):
        raise ValueError(
            f"`searcher.{field}` is adaptive_asha's; optuna's pruner takes only "
            "divisor and max_rungs: remove it"
        )


def _make(config: ExperimentConfig, max_batches: int | None) -> Searcher:
    from det_tasks.searchers.optuna.search import make_optuna_searcher

    options = OptunaOptions.model_validate(config.searcher.plugin_fields)
    return make_optuna_searcher(config, max_batches, options.sampler, options.pruner)


def _counts_in_batches(searcher: SearcherConfig) -> bool:
    """Its pruner judges at rungs counted in batches (none without a pruner)."""
    return searcher.plugin_fields.get("pruner", "asha") != "none"  # checked after this


PLUGIN = SearcherPlugin(
    make=_make, options=OptunaOptions, check=_check, counts_in_batches=_counts_in_batches
)
