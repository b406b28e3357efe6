"""Two people on one stack: an experiment started while another's trials train on the
stack's workers leaves those trials alone. Every flow run installs what it needs on the
shared workers; installing it again must not tear down what the first one's trials hold
(Dask replaces a plugin registered again under its name, and its teardown released the
held trial mid-step: the trial failed and spent a restart)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from registry.checkpoints.models import trial_runs
from registry.runs.tracking import client_for
from tests.integration.helpers import flow_experiment


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _latest_trials(name: str) -> list:
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    (parent, *_) = client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`det.experiment_run` != ''",
        order_by=["attributes.start_time DESC"],
    )
    return trial_runs(client, parent)


def test_a_second_experiment_leaves_the_first_ones_trials_training(stack, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    first_pids, second_pids = tmp_path / "first", tmp_path / "second"
    # 4 trials, 2 at a time on the stack's 2 workers, no restart allowed: a step that fails
    # fails the experiment; each trial writes its worker's pid once per build.
    first = flow_experiment(
        "grid.yaml",
        "hyperparameters.sleep_s=0.05",
        "searcher.max_length.batches=80",
        "max_restarts=0",
        f"data.pid_file={first_pids}",
    )
    deadline = time.monotonic() + 300
    while len(_lines(first_pids)) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_lines(first_pids)) >= 2, first.communicate()[1][-3000:]
    second = flow_experiment(
        "killable.yaml",
        "hyperparameters.sleep_s=0",
        "searcher.max_length.batches=30",
        "max_restarts=0",
        f"data.pid_file={second_pids}",
    )
    _, second_err = second.communicate(timeout=600)
    _, first_err = first.communicate(timeout=600)
    assert second.returncode == 0, second_err[-3000:]
    assert first.returncode == 0, first_err[-3000:]
    # Each of the first experiment's 4 trials was built once: none was released under it
    # and rebuilt from a checkpoint; nothing failed or restarted.
    assert len(_lines(first_pids)) == 4
    assert "Retry" not in first_err and "Failed" not in first_err
    trials = _latest_trials("flow-grid")
    assert len(trials) == 4
    assert {t.info.status for t in trials} == {"FINISHED"}
    assert {t.data.metrics["progress/batches"] for t in trials} == {80}
    (single,) = _latest_trials("flow-killable")
    assert single.info.status == "FINISHED"
    assert single.data.metrics["progress/batches"] == 30
