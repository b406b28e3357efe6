"""The saved view MLflow's runs page opens for an experiment: the state MLflow 3.17's UI
reads from the experiment tag ``mlflow.sharedViewState.<key>`` when the page is opened
with ``?viewStateShareKey=<key>``, and lists by name in the runs page's "Views" menu.

Without it a user lands on the first 10 runs, trials folded under their parent, with the
Source, Models and Dataset columns. The view instead shows every trial flat (a search
filter or a metric ordering turns MLflow's nesting off), best first by the searcher metric,
with the trial's state and its hyperparameters as columns; its Chart view opens on the
searcher metric against the searched hyperparameters (parallel coordinates, one scatter
per hyperparameter) and over batches.

The tag holds MLflow's saved-view envelope (``{"name", "createdAt", "updatedAt", "state"}``,
``state`` a JSON string): the envelope is what puts the view in the "Views" menu (a plain
state opens from the link but is not listed).
"""

from __future__ import annotations

import json
from typing import Any

from det_tasks.config.hyperparameters import ConstHP, flatten_hparams, parse_hyperparameters

__all__ = [
    "TRIALS_VIEW_KEY",
    "TRIALS_VIEW_TAG",
    "saved_view_state",
    "searched_hparams",
    "trials_charts",
    "trials_view",
    "trials_view_tag",
]

TRIALS_VIEW_KEY = "det-trials"
TRIALS_VIEW_TAG = f"mlflow.sharedViewState.{TRIALS_VIEW_KEY}"
TRIALS_FILTER = "tags.`det.trial_id` != ''"  # trial runs only: no parent rows
# MLflow 3's longest experiment tag value; a longer view is saved without its charts.
VIEW_TAG_LIMIT = 20_000
PARALLEL_AXES = 10  # more hyperparameter axes than this are unreadable
SCATTERS = 4  # one scatter per searched hyperparameter, at most this many
_SECTION = "det-searcher"  # ids of our chart section and charts: fixed, so rewrites agree


def trials_view(metric: str | None, smaller_is_better: bool, hp_columns: list[str]) -> str:
    """The view's table state as JSON: trials of every run of the experiment, ordered by
    ``validation/<metric>`` (none: newest first), columns ``det.state``, the metric and
    ``hp_columns`` (param names, e.g. ``hp.learning_rate``)."""
    columns = ["tags.`det.state`"]
    state: dict[str, object] = {"searchFilter": TRIALS_FILTER}
    if metric:
        key = f"metrics.`validation/{metric}`"
        columns.append(key)
        state.update(orderByKey=key, orderByAsc=smaller_is_better)
    columns += [f"params.`{name}`" for name in hp_columns]
    state.update(selectedColumns=columns, runsHiddenMode="SHOW_ALL")
    return json.dumps(state)


def trials_charts(metric: str, hp_params: list[str]) -> dict[str, Any]:
    """The view's chart state: a first section "<metric> against the hyperparameters" with
    a parallel-coordinates chart of ``validation/<metric>`` over ``hp_params``, one scatter
    per hyperparameter and the metric's curve over batches. MLflow adds its own charts of
    the other metrics in sections after it (``isAccordionReordered`` keeps ours first)."""
    key = f"validation/{metric}"
    charts = [
        _chart(
            "PARALLEL",
            "parallel",
            selectedParams=hp_params[:PARALLEL_AXES],
            selectedMetrics=[key],
            showAllRuns=False,
        ),
        *(
            _chart(
                "SCATTER",
                f"scatter-{name}",
                runsCountToCompare=100,
                xaxis={"key": name, "type": "PARAM"},
                yaxis={"key": key, "type": "METRIC"},
            )
            for name in hp_params[:SCATTERS]
        ),
        _line_chart(key),
    ]
    section = {
        "uuid": _SECTION,
        "name": f"{metric} against the hyperparameters",
        "display": True,
        "isReordered": False,
        "deleted": False,
        "isGenerated": False,
    }
    return {
        "compareRunCharts": charts,
        "compareRunSections": [section],
        "isAccordionReordered": True,
    }


def _chart(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    """A chart card as MLflow's UI builds one (``RunsChartsCardConfig``): the base fields,
    then the kind's own."""
    base = {
        "uuid": f"{_SECTION}-{name}",
        "type": kind,
        "runsCountToCompare": 10,
        "metricSectionId": _SECTION,
        "deleted": False,
        "isGenerated": False,
    }
    return {**base, **fields}


def _line_chart(key: str) -> dict[str, Any]:
    return _chart(
        "LINE",
        "curve",
        metricKey=key,
        lineSmoothness=0,
        xAxisScaleType="linear",
        scaleType="linear",
        range={},  # MLflow's own saved charts: every bound unset, as JSON writes it
        xAxisKey="step",  # our metrics' step is the batch count
        selectedXAxisMetricKey="",
        yAxisKey="metric",
        yAxisExpressions=[],
        ignoreOutliers=False,
        useGlobalXaxisKey=False,
        useGlobalLineSmoothing=True,
    )


def trials_view_tag(
    metric: str | None,
    smaller_is_better: bool,
    hp_columns: list[str],
    searched: set[str],
    now_ms: int,
) -> str:
    """The tag's value: the saved-view envelope named "Trials by <metric>" around the table
    state and, with a metric, the charts of the searched hyperparameters among
    ``hp_columns`` (``searched`` holds names without ``hp.``; none searched: all)."""
    state = json.loads(trials_view(metric, smaller_is_better, hp_columns))
    name = f"Trials by {metric}" if metric else "Trials"
    plain = _envelope(name, state, now_ms)
    if not metric:
        return plain
    params = [c for c in hp_columns if c.removeprefix("hp.") in searched] or hp_columns
    charted = _envelope(name, {**state, **trials_charts(metric, params)}, now_ms)
    return charted if len(charted) <= VIEW_TAG_LIMIT else plain


def _envelope(name: str, state: dict[str, Any], now_ms: int) -> str:
    return json.dumps(
        {"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}
    )


def saved_view_state(tag_value: str) -> dict[str, Any]:
    """The view state in a ``mlflow.sharedViewState.*`` tag, in either form MLflow reads: the
    saved-view envelope or a bare state."""
    value = json.loads(tag_value)
    if isinstance(value, dict) and isinstance(value.get("state"), str):
        state = json.loads(value["state"])
        return state if isinstance(state, dict) else {}
    return value if isinstance(value, dict) else {}


def searched_hparams(raw_config: dict[str, Any]) -> set[str]:
    """The flattened names (``hp.<name>`` without ``hp.``) of the hyperparameters the
    searcher varies (any ``type`` but ``const``); a categorical whose values are mappings
    adds its flattened keys (``opt.lr``) beside its own name."""
    try:
        space = parse_hyperparameters(raw_config.get("hyperparameters") or {})
    except ValueError:  # validated before any trial ran; a partial config has no space
        return set()
    return _searched(space, "")


def _searched(node: dict[str, Any], prefix: str) -> set[str]:
    names: set[str] = set()
    for key, value in node.items():
        if isinstance(value, dict):
            names |= _searched(value, f"{prefix}{key}.")
        elif not isinstance(value, ConstHP):
            names.add(f"{prefix}{key}")
            for choice in getattr(value, "vals", []):
                if isinstance(choice, dict):
                    names |= {f"{prefix}{key}.{k}" for k in flatten_hparams(choice)}
    return names
