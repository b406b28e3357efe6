"""Determined's ``continue`` without servers: ``python -m flows.experiment CONFIG --continue
KEY`` takes a single-trial experiment that ended (COMPLETED, or orphaned by a SIGKILLed
launcher) on from its trial's newest checkpoint, in the same MLflow runs. A relaunch of the
same command after a SIGKILL starts afresh and prints the line that continues the old one.
Known answers: the continued trial's training losses and final weights equal those of one
run of the full length."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.helpers import environment, home_env, killable_runs

REPO = Path(__file__).resolve().parents[2]
FLOW_MODEL = REPO / "tests" / "fixtures" / "flow_model"
CONFIG = FLOW_MODEL / "killable.yaml"  # one trial, 120 batches, checkpoints every 30
FAST = "hyperparameters.sleep_s=0"


def _flow(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), *args],
        cwd=home,
        env=home_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _parent_and_trial(home: Path, key: str | None = None) -> tuple[Any, Any]:
    runs = killable_runs(home)
    parents = [r for r in runs if r.data.tags.get("det.experiment_run")]
    parent = next(p for p in parents if key is None or p.data.tags["det.experiment_run"] == key)
    trial = next(r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    return parent, trial


def _losses(home: Path, run_id: str) -> list[tuple[int, float]]:
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    return [(m.step, m.value) for m in client.get_metric_history(run_id, "training/loss")]


def _final_weights(home: Path, trial: Any) -> dict[str, torch.Tensor]:
    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    store = f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}"
    records = checkpoint_records(client_for(store), trial.info.run_id)
    with environment(replace=home_env(home), MLFLOW_TRACKING_URI=store):
        loaded = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
    return dict(loaded.model.state_dict())


def test_continue_a_completed_trial_to_a_larger_length_trains_only_the_extra_batches(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    short = _flow(tmp_path, FAST, "searcher.max_length.batches=60")
    assert short.returncode == 0, short.stderr[-3000:]
    parent, trial = _parent_and_trial(tmp_path)
    key = parent.data.tags["det.experiment_run"]

    same = _flow(tmp_path, FAST, "searcher.max_length.batches=60", "--continue", key)
    assert same.returncode == 2
    assert "nothing more to train" in same.stderr, same.stderr[-2000:]
    untouched, _ = _parent_and_trial(tmp_path, key)
    assert (untouched.info.status, untouched.data.tags["det.state"]) == ("FINISHED", "COMPLETED")

    longer = _flow(tmp_path, FAST, "searcher.max_length.batches=120", "--continue", key)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "continues from its newest checkpoint, batch 60 to 120 batches" in longer.stderr
    assert "train trial-1 60-120" in longer.stderr  # the extra batches, and only those
    parent_after, trial_after = _parent_and_trial(tmp_path, key)
    assert (parent_after.info.run_id, trial_after.info.run_id) == (
        parent.info.run_id,
        trial.info.run_id,
    )
    assert len(killable_runs(tmp_path)) == 2  # no new run
    for run in (parent_after, trial_after):
        assert (run.info.status, run.data.tags["det.state"]) == ("FINISHED", "COMPLETED")

    # One run of 120 batches in another home: the same losses at the same steps, each once,
    # and bit-equal final weights.
    reference_home = tmp_path / "reference"
    reference_home.mkdir()
    whole = _flow(reference_home, FAST)
    assert whole.returncode == 0, whole.stderr[-3000:]
    _, reference = _parent_and_trial(reference_home)
    assert _losses(tmp_path, trial.info.run_id) == _losses(reference_home, reference.info.run_id)
    want = _final_weights(reference_home, reference)
    got = _final_weights(tmp_path, trial_after)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_sigkilled_launcher_is_named_by_the_relaunch_and_continues_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    pid_file = tmp_path / "pids"
    command = [sys.executable, "-m", "flows.experiment", str(CONFIG), "hyperparameters.sleep_s=0.1"]
    proc = subprocess.Popen(
        [*command, f"data.pid_file={pid_file}"],
        cwd=tmp_path,
        env=home_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    parent = _wait_for_checkpoint(tmp_path, proc, at_least=30)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its workers and its server: all gone
    proc.communicate(timeout=60)
    key = parent.data.tags["det.experiment_run"]
    _, trial = _parent_and_trial(tmp_path, key)

    again = _flow(tmp_path, "hyperparameters.sleep_s=0")  # the same command, typed again
    assert again.returncode == 0, again.stderr[-3000:]
    line = re.search(
        rf"experiment {key[:8]} of this config stopped at batch (\d+) without finishing; "
        rf"continue it with: python -m flows\.experiment (\S+) (.*) --activate {key}",
        again.stderr,
    )
    assert line, again.stderr[-3000:]
    assert 30 <= int(line.group(1)) < 120
    assert line.group(2) == str(CONFIG)
    orphan, _ = _parent_and_trial(tmp_path, key)
    assert orphan.data.tags["det.state"] == "ORPHANED"

    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    newest = max(r["steps_completed"] for r in checkpoint_records(client, trial.info.run_id))
    resumed = _flow(tmp_path, FAST, "--continue", key)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(ORPHANED) continues from its newest checkpoint, batch {newest}" in resumed.stderr
    assert f"train trial-1 {newest}-120" in resumed.stderr
    parent_after, trial_after = _parent_and_trial(tmp_path, key)
    assert trial_after.info.run_id == trial.info.run_id
    for run in (parent_after, trial_after):
        assert (run.info.status, run.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    assert checkpoint_records(client, trial.info.run_id)[-1]["steps_completed"] == 120


def _wait_for_checkpoint(home: Path, proc: subprocess.Popen[str], at_least: int) -> Any:
    """The experiment's parent run once its trial recorded a checkpoint at ``at_least``."""
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    store = home / "det" / "mlflow.db"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if not store.is_file():
            continue
        try:
            parent, trial = _parent_and_trial(home)
        except (AssertionError, StopIteration):
            continue
        client = client_for(f"sqlite:///{store.resolve()}")
        steps = [r["steps_completed"] for r in checkpoint_records(client, trial.info.run_id)]
        if steps and max(steps) >= at_least:
            return parent
    raise AssertionError(f"no checkpoint at {at_least}: {proc.communicate()[1][-3000:]}")


def test_a_search_is_refused_in_one_line_that_says_what_to_use(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from det_tasks.runner.trial_setup import load_raw_config
    from registry.experiments.continuation import plan_continuation
    from registry.runs.run_states import end_running_runs
    from registry.runs.tracking import ExperimentRuns, client_for

    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    raw = load_raw_config(FLOW_MODEL / "grid.yaml", [])[0]
    key = "0f8c2d1e-0000-4000-8000-000000000001"
    runs = ExperimentRuns(client, "grid-continue", key, raw)
    for trial in ("1", "2"):
        runs.trial_run(trial, {"hidden": int(trial)}, {})
    end_running_runs(client, runs.experiment_id, runs.parent_run_id, "ERROR", "FAILED")
    single = load_raw_config(CONFIG, [])[1]
    with pytest.raises(Exception) as refused:
        plan_continuation(client, key, single)
    text = str(refused.value)
    assert "\n" not in text
    assert "is a grid search (2 trials): continue takes only a single-trial experiment" in text
    assert "create a single-trial experiment with its hyperparameters" in text
