"""Searchers added by name: a package registers a ``SearcherPlugin`` under the
``det_tasks.searchers`` entry points, and ``searcher.name: <entry name>`` runs it.

The plug-in brings its own ``searcher.*`` fields (a ``SearcherOptions`` model, checked as
strictly as the rest of the config, with the same one-line errors) and its own rules on the
shared fields (``check``). Its searcher is built only when an experiment runs (``make``), so a
plug-in whose library is heavy or missing costs nothing until then. Optuna
(``det_tasks.searchers.optuna.options``) is one, registered by this project's own
``pyproject.toml``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from det_tasks.errors import ConfigError
from det_tasks.plugins import entry_names, load_one

__all__ = [
    "BUILT_IN_SEARCHERS",
    "SEARCHER_PLUGINS",
    "SearcherOptions",
    "SearcherPlugin",
    "find_searcher_plugin",
    "missing_package",
    "plugin_owning",
]

SEARCHER_PLUGINS = "det_tasks.searchers"
# Determined's own names; "custom" is accepted by the config and refused when it runs.
BUILT_IN_SEARCHERS = ("single", "grid", "random", "adaptive_asha", "custom")


class SearcherOptions(BaseModel):
    """The base of a plug-in's own ``searcher.*`` fields: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class SearcherPlugin:
    """What a ``det_tasks.searchers`` entry point names.

    ``make(config, max_batches)`` builds the searcher (``max_batches`` None: trials train to
    ``searcher.max_length``); ``options`` validates the plug-in's own fields, which ``make``
    reads from ``config.searcher.plugin_fields``; ``check(searcher_config)`` raises
    ValueError for a shared field the plug-in needs or refuses (one line, naming it)."""

    # Typed loosely: the config and the searcher modules import this one.
    make: Callable[[Any, int | None], Any]  # (ExperimentConfig, max_batches) -> Searcher
    options: type[SearcherOptions] = SearcherOptions
    check: Callable[[Any], None] | None = None  # (SearcherConfig) -> None
    # (SearcherConfig) -> whether it counts its length in batches (rungs): an epoch length
    # is then refused without records_per_epoch, when the config is read.
    counts_in_batches: Callable[[Any], bool] | None = None


def find_searcher_plugin(name: str) -> SearcherPlugin:
    """The plug-in registered as ``name``, or a ConfigError that says how to get one. An entry
    point naming a bare factory (this project's first plug-in form) is taken as ``make``."""
    try:
        found = load_one(SEARCHER_PLUGINS, name)
    except ImportError as err:
        raise missing_package(name, err) from None
    if found is None:
        raise ConfigError(_unknown(name))
    if isinstance(found, SearcherPlugin):
        return found
    if callable(found):
        return SearcherPlugin(make=found)
    raise ConfigError(
        f"searcher.name {name!r}: its {SEARCHER_PLUGINS} entry point names a "
        f"{type(found).__name__}, not a det_tasks.config.searcher_plugins.SearcherPlugin"
    )


def missing_package(name: str, err: ImportError) -> ConfigError:
    """The error for plug-in ``name`` whose library is not installed (at load or at make)."""
    missing = getattr(err, "name", None) or name
    return ConfigError(
        f"searcher.name {name!r} needs the {missing!r} package, which is not installed: "
        f"pip install 'det-tasks[{name}]'"
    )


def _unknown(name: str) -> str:
    plugins = sorted(entry_names(SEARCHER_PLUGINS))
    built_in = [n for n in BUILT_IN_SEARCHERS if n != "custom"]  # custom is refused to run
    close = difflib.get_close_matches(name, built_in + plugins, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"no searcher is named {name!r}; {hint}built in: "
        f"{', '.join(built_in)}; installed plug-ins: "
        f"{', '.join(plugins) or 'none'} (a package adds one as a {SEARCHER_PLUGINS} "
        "entry point)"
    )


def plugin_owning(field: str) -> str | None:
    """The installed plug-in whose own fields include ``field`` (for the error that says a
    field belongs to another searcher); plug-ins that fail to load are skipped."""
    for name in entry_names(SEARCHER_PLUGINS):
        try:
            plugin = find_searcher_plugin(name)
        except ConfigError:
            continue
        if field in plugin.options.model_fields:
            return name
    return None
