"""A run's MLflow status and its det.state never disagree (registry.runs.trial_states): a trial
released because its experiment failed ends FAILED with ERROR, as the parent does; before,
it was released without a state and ended FINISHED COMPLETED under the FAILED parent,
however far it had trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from registry.runs.tracking import ExperimentRuns
from registry.runs.trial_states import END_STATES, Progress, run_status, trial_state

EXPECTED = {
    "COMPLETED": "FINISHED",
    "STOPPED": "FINISHED",
    "PRUNED": "FINISHED",
    "ERROR": "FAILED",
    "CANCELED": "KILLED",
    "PAUSED": "KILLED",
    "ORPHANED": "KILLED",
}


def test_every_end_state_has_its_status() -> None:
    assert {state: run_status(state, "?") for state in END_STATES} == EXPECTED
    assert run_status("INVALID_HP", "FINISHED") == "FINISHED"  # another word: as given


@pytest.mark.parametrize(
    ("asked", "state", "ended"),
    [
        ("KILLED", "ERROR", "FAILED"),  # a held trial released as its experiment failed
        ("KILLED", "PAUSED", "KILLED"),
        ("FINISHED", "STOPPED", "FINISHED"),
        ("FINISHED", None, "FINISHED"),
        ("FAILED", None, "FAILED"),
    ],
)
def test_a_finished_run_says_the_same_in_both(
    mlflow_store: tuple[Any, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    asked: str,
    state: str | None,
    ended: str,
) -> None:
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path))
    client, _ = mlflow_store
    runs = ExperimentRuns(client, "run-status", f"key-{asked}-{state}", {})
    trial = runs.trial_run("1", {}, {})
    runs.finish(trial, asked, state, Progress(10, 10))  # trained to its length
    run = client.get_run(trial)
    assert run.info.status == ended
    tag = run.data.tags.get("det.state")
    assert run_status(trial_state(run.info.status, tag), "?") == ended
