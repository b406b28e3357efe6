"""What a user sees in MLflow after `det-tasks run` against the real stack: the experiment
opens as a model-training experiment with its description and a saved view of its trials,
the parent run names the winner and logs the experiment's settings, trial runs say how they
ended and carry system metrics at the default interval, the parent run links its
interactive plotly page in the artifact viewer, the checkpoint listing is best first, and a
run that fails before its first batch (or never loads its entrypoint) leaves no runs
behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from html.parser import HTMLParser
from pathlib import Path

import pytest

from registry.runs.trials_view import saved_view_state
from tests.integration.helpers import FLOW_MODEL, run_xor_trial
from tests.integration.prefect_artifacts import trials_table_and_progress

QUICK = [
    "--param",
    "min_validation_period={batches: 20}",
    "--param",
    "min_checkpoint_period={batches: 20}",
]


def platform_env(**extra: str) -> dict[str, str]:
    """The stack's environment at the defaults users get (no sampling interval set)."""
    env = {**os.environ, **extra}
    env.pop("DET_TASKS_SYSTEM_METRICS_INTERVAL", None)
    return env


def det_tasks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *args],
        env=platform_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


class _Scripts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def plotly_traces(html: str) -> list[dict]:
    """The traces handed to Plotly.newPlot in the page (parsed, not grepped)."""
    parser = _Scripts()
    parser.feed(html)
    call = next(s for s in parser.scripts if "Plotly.newPlot(" in s and "plotly.js v" not in s)
    start = call.index("Plotly.newPlot(") + len("Plotly.newPlot(")
    decoder = json.JSONDecoder()
    _, end = decoder.raw_decode(call, call.index('"', start))  # the div id
    traces, _ = decoder.raw_decode(call, call.index("[", end))
    return list(traces)


def publish_trials_table(name: str, trials: dict) -> tuple[object, dict | None]:
    """A flow run that keeps the trials table of these (finished) trial runs as the
    experiment flow does: published as each trial runs and ends, and once at the end.
    Each trial is given only its last validation, as a flow sees a one-segment trial."""
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.trial_table import TrialTable
    from registry.runs.tracking import client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])

    @flow(name="trials-table")
    def keep_table() -> tuple[object, dict | None]:
        table = TrialTable(name, "validation_loss", True, str, total_trials=len(trials))
        for trial_id, run in sorted(trials.items()):
            hparams = {k[3:]: float(v) for k, v in run.data.params.items() if k.startswith("hp.")}
            table.add(int(trial_id), hparams, run.info.run_id)
            table.set_state(int(trial_id), "RUNNING")
            table.publish()
            (last,) = client.get_metric_history(run.info.run_id, "validation/validation_loss")[-1:]
            table.segment_done(int(trial_id), last.step, last.value, None)
            table.set_state(int(trial_id), "COMPLETED")
            table.publish()
        table.publish()
        return flow_run.get_id(), table.best()

    return keep_table()


def test_experiment_run_shows_winner_system_metrics_plots_and_sorted_listing(stack, tmp_path):
    """Two trials of one experiment run (as the flow runs them: `det-tasks run` with
    --experiment-run), then the registry's end of the experiment run, as the flow calls it."""
    from registry.jobs.trial_services import finish_experiment
    from registry.runs.tracking import ExperimentRuns, client_for
    from registry.servers.s3 import client as s3_client

    name = f"ux-{uuid.uuid4().hex[:6]}"
    key = uuid.uuid4().hex
    summaries = {}
    for trial_id, lr in (("1", "0.02"), ("2", "0.5")):
        proc = run_xor_trial(
            name,
            60,
            platform_env(),
            FLOW_MODEL,
            *QUICK,
            "--param",
            "description=XOR, as a user sees it",
            "--experiment-run",
            key,
            "--trial-id",
            trial_id,
            "--param",
            f"hyperparameters.learning_rate={lr}",
        )
        assert proc.returncode == 0, proc.stderr
        assert "Found credentials" not in proc.stderr
        summaries[trial_id] = json.loads(proc.stdout)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(name)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment.tags["mlflow.note.content"] == "XOR, as a user sees it"

    raw = {"searcher": {"metric": "validation_loss", "smaller_is_better": True}}
    runs = ExperimentRuns(client, name, key, raw)
    finish_experiment(runs, s3_client(os.environ["MLFLOW_S3_ENDPOINT_URL"]))
    parent = client.get_run(runs.parent_run_id)
    trials = {
        r.data.tags["det.trial_id"]: r
        for r in client.search_runs(
            [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
    }
    for trial_id, trial in trials.items():
        link = f"#/experiments/{experiment.experiment_id}/runs/{trial.info.run_id}"
        assert summaries[trial_id]["mlflow_run"].endswith(f"{link}?workflowType=machine_learning")
        # How each trial ended: trained to its length, a normal end.
        assert trial.info.status == "FINISHED" and trial.data.tags["det.state"] == "COMPLETED"

    # The parent run logs the experiment's settings, flattened like hp.*, defaults filled in.
    params = parent.data.params
    sections = ("searcher.", "resources.", "reproducibility.")
    periods = ("min_validation_period.", "min_checkpoint_period.")
    top = {"checkpoint_policy", "perform_initial_validation", "max_restarts"}
    assert all(k.startswith(sections + periods) or k in top for k in params), sorted(params)
    assert params["searcher.name"] == "single"
    assert params["searcher.metric"] == "validation_loss"
    assert params["searcher.smaller_is_better"] == "True"
    assert params["searcher.max_length.batches"] == "120"
    assert params["searcher.max_concurrent_trials"] == "16"  # Determined's default
    assert params["resources.slots_per_trial"] == "1"
    assert params["resources.distributed_backend"] == "auto"
    assert params["min_validation_period.batches"] == "20"
    assert params["max_restarts"] == "2" and params["checkpoint_policy"] == "none"
    assert params["reproducibility.experiment_seed"] == "0"
    for trial in trials.values():  # the trials carry the same settings beside their hp.*
        assert {k: v for k, v in trial.data.params.items() if not k.startswith("hp.")} == params

    # The experiment's link opens its saved view: trials flat, best first, metric and hp.*.
    view = saved_view_state(experiment.tags["mlflow.sharedViewState.det-trials"])
    assert view["orderByKey"] == "metrics.`validation/validation_loss`" and view["orderByAsc"]
    assert view["runsHiddenMode"] == "SHOW_ALL"
    assert view["selectedColumns"] == [
        "tags.`det.state`",
        "metrics.`validation/validation_loss`",
        "params.`hp.global_batch_size`",
        "params.`hp.hidden`",
        "params.`hp.learning_rate`",
        "params.`hp.sleep_s`",
    ]
    matched = client.search_runs([experiment.experiment_id], view["searchFilter"])
    assert {r.info.run_id for r in matched} == {t.info.run_id for t in trials.values()}

    # The winner on the parent run: metric at its step, hparams, best checkpoint.
    scored = [
        (m.value, m.step, trial_id)
        for trial_id, trial in trials.items()
        for m in client.get_metric_history(trial.info.run_id, "validation/validation_loss")
    ]
    value, step, winner = min(scored)
    tags = parent.data.tags
    assert tags["det.best.trial_id"] == winner
    assert tags["det.best.run_id"] == trials[winner].info.run_id
    assert tags["det.best.step"] == str(step)
    lr = {"1": "0.02", "2": "0.5"}[winner]
    assert tags["det.best.hp.learning_rate"] == lr and tags["det.best.hp.hidden"] == "6"
    assert parent.data.metrics["validation/validation_loss"] == pytest.approx(value)
    records = [
        json.loads(v)
        for trial in trials.values()
        for k, v in trial.data.tags.items()
        if k.startswith("det.checkpoint.")
    ]
    best_record = min(records, key=lambda r: r["validation_metrics"]["validation_loss"])
    assert tags["det.best.checkpoint"] == best_record["uri"]

    # `det-tasks experiment describe` and the flow's trials table name the same winner.
    from flows.trial_table import significant
    from registry.experiments.view import describe_experiment_run

    view = describe_experiment_run(client, key)
    assert view is not None and view.best is not None
    assert (view.best.trial_id, view.best.metric, view.best.best_step) == (winner, value, step)
    assert view.best.checkpoint == tags["det.best.checkpoint"]
    flow_run_id, summary = publish_trials_table(name, trials)
    rows, progress = trials_table_and_progress(flow_run_id)
    assert progress == 100.0
    assert sorted(r["trial"] for r in rows) == [1, 2]
    top = rows[0]
    assert str(top["trial"]) == winner and top["best at batch"] == step
    assert top["best validation_loss"] == significant(value)
    assert top["best checkpoint"] == tags["det.best.checkpoint"]
    assert {r["learning_rate"] for r in rows} == {0.02, 0.5}
    assert summary is not None
    assert (str(summary["trial_id"]), summary["metric"], summary["step"]) == (winner, value, step)

    # System metrics on the trial runs at the default interval (1 s), plus one sample when
    # the run ends: a run of a few seconds has its points, numbered 0, 1, 2...
    for trial in trials.values():
        metrics = trial.data.metrics
        for key_ in (
            "system/cpu_utilization_percentage",
            "system/system_memory_usage_megabytes",
            "system/disk_usage_percentage",
            "system/network_receive_megabytes",
        ):
            assert key_ in metrics, sorted(metrics)
        history = client.get_metric_history(trial.info.run_id, "system/cpu_utilization_percentage")
        seconds = (trial.info.end_time - trial.info.start_time) / 1000
        assert sorted(m.step for m in history) == list(range(len(history)))
        assert 1 <= len(history) <= seconds + 1, (len(history), seconds)
        if seconds >= 4:  # sampled while it trained, not only at its end
            assert len(history) >= 2, (len(history), seconds)

    # The PNG stays; the interactive page is there, linked from the parent's description in
    # MLflow's artifact viewer (a plain artifact link downloads it), with every trial's curve.
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"learning_curves.png", "experiment.html"} <= artifacts
    viewer = (
        f"{os.environ['MLFLOW_TRACKING_URI']}/#/experiments/{experiment.experiment_id}/runs/"
        f"{parent.info.run_id}/artifacts/experiment.html?workflowType=machine_learning"
    )
    assert f"[experiment.html]({viewer})" in parent.data.tags["mlflow.note.content"]
    page = Path(client.download_artifacts(parent.info.run_id, "experiment.html", str(tmp_path)))
    traces = plotly_traces(page.read_text())
    assert [t["x"] for t in traces if t.get("name") in ("trial-1", "trial-2")] == [
        [20, 40, 60],
        [20, 40, 60],
    ]
    (scatter,) = traces[2:]  # one per hyperparameter the trials differ in
    assert scatter["name"] == "learning_rate" and sorted(scatter["x"]) == [0.02, 0.5]

    # `det-tasks checkpoints` lists them best first.
    listing = det_tasks("checkpoints", name)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[2:]]
    assert {r[0] for r in rows} == {"trial-1", "trial-2"} and len(rows) == 6
    values = [float(r[2]) for r in rows]
    assert values == sorted(values) and values[0] == pytest.approx(value), listing.stdout

    # metadata.json carries the real trial id.
    fetched = det_tasks("download", best_record["uri"], str(tmp_path / "ckpt"))
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["trial_id"] == winner


def test_failures_before_training_leave_no_runs(stack, tmp_path):
    from mlflow.entities import ViewType

    from registry.runs.tracking import client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    model = tmp_path / "model"
    shutil.copytree(FLOW_MODEL, model)

    # A wrong entrypoint class: found before any MLflow run exists.
    name = f"ux-entry-{uuid.uuid4().hex[:6]}"
    proc = run_xor_trial(name, 5, platform_env(), model, "--param", "entrypoint=model_def:Xor")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model_def.py has no 'Xor'" in proc.stderr
    assert client.get_experiment_by_name(name) is None

    # A misspelt hyperparameter: fails in the trial's __init__, after the runs were made;
    # the empty FAILED pair is deleted, and the error names the user's line.
    name = f"ux-hparam-{uuid.uuid4().hex[:6]}"
    config = model / "killable.yaml"
    config.write_text(config.read_text().replace("learning_rate:", "learnign_rate:"))
    proc = run_xor_trial(name, 5, platform_env(), model)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"model_def\.py:\d+: hyperparameter 'learning_rate'", proc.stderr)
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    assert client.search_runs([experiment.experiment_id], run_view_type=ViewType.ACTIVE_ONLY) == []
    deleted = client.search_runs([experiment.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    assert len(deleted) == 2
    # Ended before they were deleted: a deleted run left RUNNING would never end.
    assert all(r.info.status == "FAILED" and r.info.end_time for r in deleted)

    # The same mistake in a trial of a flow's experiment run: the run stays, FAILED, tagged
    # with the error (the flow owns the parent run; its other trials may be fine).
    proc = run_xor_trial(name, 5, platform_env(), model, "--experiment-run", uuid.uuid4().hex)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (failed,) = client.search_runs(
        [experiment.experiment_id], "tags.`det.trial_id` = '1'", ViewType.ACTIVE_ONLY
    )
    assert failed.info.status == "FAILED"
    assert "hyperparameter 'learning_rate' is not defined" in failed.data.tags["det.error"]
