"""Which experiment runs ``det experiment continue`` takes (registry.experiments.continuation),
asked of a real MLflow store (SQLite), and how a ``--config-file`` becomes overrides:
Determined's rules (terminal states, single searcher, the override keeps it single) plus
ours (a length below what was trained is refused; the same length on a COMPLETED trial does
nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from det_cli.continue_verb import file_overrides
from det_tasks.config.loader import apply_overrides
from det_tasks.errors import DetTasksError
from det_tasks.runner.trial_setup import load_raw_config
from registry.experiments.continuation import (
    NothingToContinue,
    apply_continuation,
    plan_continuation,
)
from registry.runs.run_states import end_running_runs
from registry.runs.searcher_state import load_searcher_state, save_searcher_state
from registry.runs.tracking import ExperimentRuns, client_for

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "fixtures" / "flow_model" / "killable.yaml"
KEY = "0f8c2d1e-0000-4000-8000-00000000000a"


def _ended_single(tmp_path: Path, state: str, status: str, checkpoint_at: int | None) -> Any:
    """A single-trial experiment run ended ``state``; its trial checkpointed at one batch."""
    from registry.checkpoints.store import record_checkpoint

    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    raw, _ = load_raw_config(CONFIG, [])
    runs = ExperimentRuns(client, "flow-killable", KEY, raw)
    trial = runs.trial_run("1", {"hidden": 6}, {})
    if checkpoint_at is not None:
        record = {"uuid": "u-1", "steps_completed": checkpoint_at, "uri": "s3://b/ck"}
        record_checkpoint(client, trial, record)
    save_searcher_state(client, runs.parent_run_id, {"results": {"1": {"120": 0.1}}})
    end_running_runs(client, runs.experiment_id, runs.parent_run_id, state, status)
    return client, runs, trial


def _cfg(*overrides: str) -> Any:
    return load_raw_config(CONFIG, list(overrides))[1]


def test_a_completed_trial_continues_to_a_larger_length_from_its_newest_checkpoint(tmp_path):
    client, runs, trial = _ended_single(tmp_path, "COMPLETED", "FINISHED", 120)
    plan = plan_continuation(client, KEY, _cfg("searcher.max_length.batches=200"))
    assert (plan.state, plan.resumes_at, plan.length) == ("COMPLETED", 120, "200 batches")
    assert plan.trial_run_id == trial
    raw = apply_overrides(load_raw_config(CONFIG, [])[0], ["searcher.max_length.batches=200"])
    apply_continuation(client, plan, raw)
    for run_id in (runs.parent_run_id, trial):
        run = client.get_run(run_id)
        assert (run.info.status, run.data.tags["det.state"]) == ("KILLED", "PAUSED")
    parent = client.get_run(runs.parent_run_id)
    assert load_searcher_state(parent.data.tags) == {"results": {}, "invalid": []}
    assert '"batches": 200' in parent.data.tags["det.config"]


def test_the_same_length_on_a_completed_trial_changes_nothing(tmp_path):
    client, runs, _ = _ended_single(tmp_path, "COMPLETED", "FINISHED", 120)
    with pytest.raises(NothingToContinue, match="nothing more to train"):
        plan_continuation(client, KEY, _cfg())
    assert client.get_run(runs.parent_run_id).data.tags["det.state"] == "COMPLETED"


def test_a_length_below_the_trained_batches_is_refused(tmp_path):
    client, _, _ = _ended_single(tmp_path, "ERROR", "FAILED", 90)
    with pytest.raises(DetTasksError, match="batches=60 is below the 90 batches"):
        plan_continuation(client, KEY, _cfg("searcher.max_length.batches=60"))


def test_an_errored_trial_without_a_checkpoint_starts_over(tmp_path):
    client, _, _ = _ended_single(tmp_path, "ERROR", "FAILED", None)
    plan = plan_continuation(client, KEY, _cfg())
    assert (plan.state, plan.resumes_at) == ("ERROR", 0)
    assert "batch 0 (no checkpoint)" in plan.summary()


def test_a_running_experiment_and_a_changed_searcher_are_refused(tmp_path):
    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    raw, _ = load_raw_config(CONFIG, [])
    runs = ExperimentRuns(client, "flow-killable", KEY, raw)
    from registry.runs.run_states import heartbeat

    heartbeat(client, runs.parent_run_id)
    with pytest.raises(DetTasksError, match="already active"):
        plan_continuation(client, KEY, _cfg())
    end_running_runs(client, runs.experiment_id, runs.parent_run_id, "CANCELED")
    grid = load_raw_config(REPO / "tests" / "fixtures" / "flow_model" / "grid.yaml", [])[1]
    with pytest.raises(DetTasksError, match=r"keeps searcher\.name: single"):
        plan_continuation(client, KEY, grid)
    with pytest.raises(DetTasksError, match="not an experiment key"):
        plan_continuation(client, "nope", _cfg())


def test_a_config_file_becomes_dotted_overrides_merged_field_by_field(tmp_path):
    changes = tmp_path / "more.yaml"
    changes.write_text("searcher:\n  max_length: {batches: 200}\nlabels: [a, b]\n")
    assert file_overrides(changes) == ["searcher.max_length.batches=200", 'labels=["a", "b"]']
    raw = apply_overrides(load_raw_config(CONFIG, [])[0], file_overrides(changes))
    assert raw["searcher"]["max_length"] == {"batches": 200}
    assert raw["searcher"]["name"] == "single"  # merged, not replaced
    empty = tmp_path / "empty.yaml"
    empty.write_text("[]\n")
    with pytest.raises(DetTasksError, match="non-empty YAML mapping"):
        file_overrides(empty)
