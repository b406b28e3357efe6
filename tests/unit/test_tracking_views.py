"""The pure parts of what users read in Prefect and MLflow: task names, the experiment's
settings as flattened params, the state words, the saved runs view and the printed links,
and the plots' axes, colours and titles."""

from __future__ import annotations

import json

import pytest

from registry.metrics.plots import TrialCurve, interactive_figure, log_scaled, trial_colors
from registry.runs.tracking import experiment_params, flat_params, mlflow_link, report_link
from registry.runs.trial_states import trial_state
from registry.runs.trials_view import TRIALS_VIEW_TAG, trials_view

ASHA = {
    "name": "asha",
    "entrypoint": "model_def:T",
    "hyperparameters": {
        "global_batch_size": 8,
        "learning_rate": {"type": "log", "minval": -3, "maxval": -1},
        "net": {"width": {"type": "int", "minval": 2, "maxval": 8}, "act": "relu"},
        "scale": {"type": "log", "minval": 0, "maxval": 2, "base": 2},
    },
    "searcher": {
        "name": "adaptive_asha",
        "metric": "validation_error",
        "max_length": {"batches": 200},
        "max_trials": 16,
    },
    "resources": {"slots_per_trial": 2},
    "min_validation_period": {"batches": 50},
}


def test_task_names_are_short_ascii_and_keep_the_trial():
    from det_tasks.runner.held import TrialSpec
    from flows.tasks import TrialRef

    spec = TrialSpec(config_path="c.yaml", model_dir=".", overrides=(), trial_id=14, hparams={})
    ref = TrialRef(spec=spec, parent_run_id="p" * 32, experiment_id="1", mlflow_run_id="a" * 32)
    assert ref.task_name("train", "50-200") == "train trial-14 50-200"
    assert ref.task_name("validate", "@200") == "validate trial-14 @200"
    assert ref.task_name("checkpoint", "@200") == "checkpoint trial-14 @200"


def test_experiment_params_are_flattened_with_defaults_filled_in():
    params = experiment_params(ASHA)
    assert params["searcher.name"] == "adaptive_asha"
    assert params["searcher.metric"] == "validation_error"
    assert params["searcher.max_length.batches"] == 200
    assert params["searcher.max_trials"] == 16
    # Left out of the YAML: Determined's defaults, as the run used them.
    assert params["searcher.smaller_is_better"] is True
    assert params["searcher.max_concurrent_trials"] == 16
    assert (params["searcher.mode"], params["searcher.divisor"]) == ("standard", 4.0)
    assert params["resources.slots_per_trial"] == 2
    assert params["resources.distributed_backend"] == "auto"
    assert params["min_validation_period.batches"] == 50
    assert params["max_restarts"] == 5 and params["checkpoint_policy"] == "best"
    assert params["reproducibility.experiment_seed"] == 0
    assert not any(k.startswith(("hp.", "hyperparameters")) for k in params)
    # Unset optional values are left out, not logged as "None".
    assert "searcher.max_time" not in params and "records_per_epoch" not in params
    assert "min_checkpoint_period.batches" not in params


def test_a_partial_config_is_logged_as_given():
    params = experiment_params({"searcher": {"metric": "loss"}})
    assert params["searcher.metric"] == "loss" and "searcher.name" not in params
    assert params["resources.slots_per_trial"] == 1


def test_trial_params_are_its_hyperparameters_and_the_experiment_settings_as_text():
    hparams = {"global_batch_size": 8, "learning_rate": 0.01, "net": {"width": 4}}
    params = flat_params(hparams, ASHA)
    assert params["hp.learning_rate"] == "0.01" and params["hp.net.width"] == "4"
    assert params["searcher.max_length.batches"] == "200"
    assert params["searcher.smaller_is_better"] == "True"
    assert {k: v for k, v in params.items() if not k.startswith("hp.")} == {
        k: str(v) for k, v in experiment_params(ASHA).items()
    }


@pytest.mark.parametrize(
    ("status", "tag", "word"),
    [
        ("RUNNING", "ACTIVE", "RUNNING"),
        ("FINISHED", "COMPLETED", "COMPLETED"),
        ("FINISHED", "STOPPED", "STOPPED"),
        ("FINISHED", "PRUNED", "PRUNED"),
        ("FINISHED", "ACTIVE", "COMPLETED"),  # reopened, then ended before it was retagged
        ("FINISHED", None, "COMPLETED"),
        ("KILLED", "PAUSED", "PAUSED"),
        ("KILLED", "CANCELED", "CANCELED"),
        ("KILLED", None, "CANCELED"),
        ("FAILED", "ERROR", "ERROR"),
        ("FAILED", None, "ERROR"),
    ],
)
def test_trial_state_words(status, tag, word):
    assert trial_state(status, tag) == word


def test_the_saved_view_shows_trials_flat_best_first_with_metric_and_hparams():
    view = json.loads(trials_view("validation_error", False, ["hp.lr", "hp.net.width"]))
    assert view == {
        "searchFilter": "tags.`det.trial_id` != ''",
        "orderByKey": "metrics.`validation/validation_error`",
        "orderByAsc": False,
        "selectedColumns": [
            "tags.`det.state`",
            "metrics.`validation/validation_error`",
            "params.`hp.lr`",
            "params.`hp.net.width`",
        ],
        "runsHiddenMode": "SHOW_ALL",
    }
    assert TRIALS_VIEW_TAG == "mlflow.sharedViewState.det-trials"
    assert "orderByKey" not in json.loads(trials_view(None, True, []))


def test_links_open_the_model_training_pages():
    uri = "http://127.0.0.1:5001/"
    assert mlflow_link(uri, "7") == (
        "http://127.0.0.1:5001/#/experiments/7/runs?viewStateShareKey=det-trials"
        "&workflowType=machine_learning"
    )
    assert mlflow_link(uri, "7", "abc") == (
        "http://127.0.0.1:5001/#/experiments/7/runs/abc?workflowType=machine_learning"
    )
    assert report_link(uri, "7", "abc", "experiment.html") == (
        "http://127.0.0.1:5001/#/experiments/7/runs/abc/artifacts/experiment.html"
        "?workflowType=machine_learning"
    )
    local = mlflow_link("sqlite:///x.db", "7")
    assert local.startswith("#/experiments/7/runs?viewStateShareKey=det-trials&workflowType=")
    assert local.endswith("in `mlflow ui --backend-store-uri sqlite:///x.db`")


@pytest.mark.parametrize("count", [1, 10, 16, 20, 21, 64])
def test_trial_colours_never_repeat(count):
    colors = trial_colors(count)
    assert len(colors) == count and len(set(colors)) == count
    assert all(c.startswith("#") and len(c) == 7 for c in colors)


def test_log_hyperparameters_are_found_nested_too():
    assert log_scaled(ASHA) == {"learning_rate", "scale"}
    assert log_scaled({}) == set()
    assert log_scaled({"hyperparameters": {"x": {"type": "log"}}}) == set()  # invalid


def test_interactive_figure_log_axes_one_colour_per_trial_and_worded_titles():
    curves = [
        TrialCurve(
            f"trial-{i}",
            [10, 20],
            [1.0 / i, 0.5 / i],
            {"learning_rate": str(10 ** (-1 - i / 8)), "net.width": str(2 + i % 3), "act": "r"},
        )
        for i in range(1, 17)
    ]
    fig = interactive_figure(curves, "validation_error", True, ASHA)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == [
        "validation_error per trial",
        "best validation_error against learning_rate (log scale)",
        "best validation_error against net.width",
    ]  # "act" is the same for all: no panel
    assert fig.layout.xaxis2.type == "log" and fig.layout.xaxis3.type != "log"
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == [c.label for c in curves]
    assert len({t.line.color for t in lines}) == 16
    by_label = {t.name: t.line.color for t in lines}
    scatter = fig.data[16]
    assert list(scatter.marker.color) == [by_label[label] for label in scatter.text]
    assert fig.layout.xaxis.title.text == "batches trained"
    assert fig.layout.yaxis.title.text == "validation validation_error"


def test_learning_curves_png_one_colour_per_trial_and_a_worded_title():
    from registry.metrics.plots import learning_curves_figure

    curves = [TrialCurve(f"trial-{i}", [1, 2], [1.0, 0.5], {}) for i in range(1, 17)]
    (ax,) = learning_curves_figure(curves, "validation_error").axes
    assert ax.get_title() == "validation_error per trial"
    assert ax.get_ylabel() == "validation validation_error"
    assert len({line.get_color() for line in ax.get_lines()}) == 16
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [c.label for c in curves]


def test_learning_curves_png_of_many_trials_names_them_in_the_html_page_not_a_legend():
    from registry.metrics.plots import learning_curves_figure

    curves = [TrialCurve(f"trial-{i}", [1, 2], [1.0, 0.5], {}) for i in range(1, 1025)]
    (ax,) = learning_curves_figure(curves, "validation_error").axes
    assert ax.get_legend() is None
    assert ax.get_title() == "validation_error per trial (1024 trials; names in experiment.html)"
    assert len(ax.get_lines()) == 1024


def test_the_logged_plots_leave_no_local_file_behind():
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from registry.metrics.plots import log_interactive_plots, log_learning_curves

    class Client(MlflowClient):
        """MLflow's own log_figure; only the upload is recorded instead of made."""

        logged: list[tuple[str, int]] = []

        def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
            self.logged.append((path, Path(path).stat().st_size))

    client = Client(tracking_uri="http://127.0.0.1:9")  # never contacted
    curves = [TrialCurve(f"trial-{i}", [1, 2], [1.0, 0.5], {"lr": 0.1 * i}) for i in (1, 2)]
    names = (
        log_learning_curves(client, "parent", curves, "validation_error"),
        log_interactive_plots(client, "parent", curves, "validation_error", True),
    )
    assert names == ("learning_curves.png", "experiment.html")
    # Each file was whole when MLflow took it, and its folder is gone since.
    assert [Path(p).name for p, _ in client.logged] == list(names)
    assert all(size > 1000 for _, size in client.logged)
    assert not any(Path(p).parent.exists() for p, _ in client.logged)
