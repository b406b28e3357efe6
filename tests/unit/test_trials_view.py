"""The experiment's saved MLflow view as MLflow 3.17's UI reads it: the envelope that lists
it in the runs page's "Views" menu, and the charts of the searcher metric against the
searched hyperparameters (tests/integration/test_mlflow_browser.py opens both in Chromium)."""

from __future__ import annotations

import json

from registry.runs.trials_view import (
    VIEW_TAG_LIMIT,
    saved_view_state,
    searched_hparams,
    trials_view,
    trials_view_tag,
)

GRID = {
    "hyperparameters": {
        "global_batch_size": 8,
        "learning_rate": {"type": "log", "minval": -3, "maxval": -1},
        "net": {"width": {"type": "int", "minval": 2, "maxval": 8}, "act": "relu"},
        "opt": {"type": "categorical", "vals": [{"name": "sgd", "lr": 0.1}, "adam"]},
    }
}
COLUMNS = ["hp.global_batch_size", "hp.learning_rate", "hp.net.act", "hp.net.width"]


def test_only_hyperparameters_the_searcher_varies_are_searched():
    assert searched_hparams(GRID) == {"learning_rate", "net.width", "opt", "opt.name", "opt.lr"}
    assert searched_hparams({"hyperparameters": {"lr": 0.1}}) == set()
    assert searched_hparams({"hyperparameters": {"x": {"type": "nope"}}}) == set()  # invalid


def test_the_tag_is_mlflows_saved_view_envelope_named_for_the_metric():
    value = json.loads(trials_view_tag("loss", True, COLUMNS, searched_hparams(GRID), 1234))
    assert value["name"] == "Trials by loss"
    assert value["createdAt"] == value["updatedAt"] == 1234
    assert isinstance(value["state"], str)  # MLflow parses the state string itself
    state = json.loads(value["state"])
    # The table part is trials_view's, unchanged.
    table = json.loads(trials_view("loss", True, COLUMNS))
    assert {k: state[k] for k in table} == table


def test_the_charts_plot_the_metric_against_the_searched_hyperparameters_first():
    tag = trials_view_tag("loss", True, COLUMNS, searched_hparams(GRID), 0)
    state = saved_view_state(tag)
    (section,) = state["compareRunSections"]
    assert section["name"] == "loss against the hyperparameters" and section["display"]
    assert state["isAccordionReordered"] is True  # MLflow keeps our section first
    charts = state["compareRunCharts"]
    assert {c["metricSectionId"] for c in charts} == {section["uuid"]}
    assert [c["type"] for c in charts] == ["PARALLEL", "SCATTER", "SCATTER", "LINE"]
    parallel, *scatters, curve = charts
    # The constants (global_batch_size, net.act) are left out of the charts.
    assert parallel["selectedParams"] == ["hp.learning_rate", "hp.net.width"]
    assert parallel["selectedMetrics"] == ["validation/loss"]
    assert [(s["xaxis"], s["yaxis"]) for s in scatters] == [
        (
            {"key": "hp.learning_rate", "type": "PARAM"},
            {"key": "validation/loss", "type": "METRIC"},
        ),
        ({"key": "hp.net.width", "type": "PARAM"}, {"key": "validation/loss", "type": "METRIC"}),
    ]
    assert curve["metricKey"] == "validation/loss" and curve["xAxisKey"] == "step"
    assert len({c["uuid"] for c in charts}) == len(charts)
    assert not any(c["deleted"] or c["isGenerated"] for c in charts)


def test_with_nothing_searched_every_hyperparameter_is_charted():
    state = saved_view_state(trials_view_tag("loss", False, ["hp.a", "hp.b"], set(), 0))
    assert state["compareRunCharts"][0]["selectedParams"] == ["hp.a", "hp.b"]
    assert state["orderByAsc"] is False


def test_without_a_metric_the_view_is_the_table_alone():
    value = json.loads(trials_view_tag(None, True, [], set(), 0))
    assert value["name"] == "Trials"
    assert saved_view_state(json.dumps(value)) == json.loads(trials_view(None, True, []))


def test_a_view_too_long_for_an_experiment_tag_drops_its_charts_not_its_columns():
    many = [f"hp.p{i:03d}_{'x' * 60}" for i in range(200)]  # the table alone: 17 KB
    tag = trials_view_tag("loss", True, many, {c.removeprefix("hp.") for c in many}, 0)
    assert len(tag) <= VIEW_TAG_LIMIT
    state = saved_view_state(tag)
    assert "compareRunCharts" not in state
    assert state["selectedColumns"][2:] == [f"params.`{c}`" for c in many]
    few = trials_view_tag("loss", True, many[:10], {c.removeprefix("hp.") for c in many}, 0)
    assert len(few) <= VIEW_TAG_LIMIT and "compareRunCharts" in saved_view_state(few)


def test_a_bare_state_written_before_the_envelope_still_reads():
    bare = trials_view("loss", True, ["hp.a"])
    assert saved_view_state(bare) == json.loads(bare)
