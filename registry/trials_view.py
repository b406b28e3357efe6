"""The saved view MLflow's runs page opens for an experiment's link: the state MLflow 3.17's
UI reads from the experiment tag ``mlflow.sharedViewState.<key>`` when the page is opened
with ``?viewStateShareKey=<key>`` (plain JSON: search facets and table state).

Without it a user lands on the first 10 runs, trials folded under their parent, with the
Source, Models and Dataset columns. The view instead shows every trial flat (a search
filter or a metric ordering turns MLflow's nesting off), best first by the searcher metric,
with the trial's state and its hyperparameters as columns.
"""

from __future__ import annotations

import json

__all__ = ["TRIALS_VIEW_KEY", "TRIALS_VIEW_TAG", "trials_view"]

TRIALS_VIEW_KEY = "det-trials"
TRIALS_VIEW_TAG = f"mlflow.sharedViewState.{TRIALS_VIEW_KEY}"
TRIALS_FILTER = "tags.`det.trial_id` != ''"  # trial runs only: no parent rows


def trials_view(metric: str | None, smaller_is_better: bool, hp_columns: list[str]) -> str:
    """The view's JSON: trials of every run of the experiment, ordered by
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
