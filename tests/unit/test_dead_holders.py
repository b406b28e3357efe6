"""Which flow runs ``det`` settles Crashed because their flow is gone (flows.lifecycle.
settle_dead_holders), against a real MLflow store (SQLite) and flow runs as Prefect reports
them: one Running past a heartbeat's patience whose flow stopped beating is settled (and its
MLflow runs end ORPHANED); one that beats, one just started again by activate or continue
(not beaten yet), and one merely scheduled are left alone."""

from __future__ import annotations

import datetime
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from flows import lifecycle
from flows.prefect_rest import FlowRun
from registry.runs.run_states import heartbeat
from registry.runs.tracking import STATE_TAG, ExperimentRuns, client_for


def _flow_run(key: str, state: str, since_s: float) -> FlowRun:
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=since_s)
    return FlowRun(uuid.UUID(key), "r", state, state.title(), "", {}, since, since)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    settled: list[str] = []
    monkeypatch.setattr(lifecycle, "settle_dead_flow_run", lambda key: settled.append(key) or True)
    return client_for(uri), settled


def _experiment(client: Any, beat_age_s: float, state: str | None = None) -> tuple[str, Any]:
    key = str(uuid.uuid4())
    runs = ExperimentRuns(client, "holders", key, {"name": "holders"})
    runs.trial_run("1", {}, {})
    heartbeat(client, runs.parent_run_id, now=time.time() - beat_age_s)
    if state:
        client.set_tag(runs.parent_run_id, STATE_TAG, state)
    return key, runs


def test_a_flow_run_whose_flow_stopped_beating_is_settled_with_its_runs(store):
    client, settled = store
    key, runs = _experiment(client, beat_age_s=120)
    assert lifecycle.settle_dead_holders(client, [_flow_run(key, "RUNNING", 300)]) == [key]
    assert settled == [key]
    parent = client.get_run(runs.parent_run_id)
    assert (parent.info.status, parent.data.tags[STATE_TAG]) == ("KILLED", "ORPHANED")


def test_live_scheduled_and_freshly_restarted_flow_runs_are_left_alone(store):
    client, settled = store
    alive, _ = _experiment(client, beat_age_s=0)  # beats, from this very process
    scheduled, _ = _experiment(client, beat_age_s=600, state="PAUSED")
    restarted, _ = _experiment(client, beat_age_s=600, state="PAUSED")  # continue, not beaten
    runs = [
        _flow_run(alive, "RUNNING", 600),
        _flow_run(scheduled, "SCHEDULED", 600),
        _flow_run(restarted, "RUNNING", 100),  # under three heartbeat patiences
    ]
    assert lifecycle.settle_dead_holders(client, runs) == []
    assert settled == []
    # The restarted one that still has not beaten after three minutes is gone too.
    assert lifecycle.settle_dead_holders(client, [_flow_run(restarted, "RUNNING", 200)]) == [
        restarted
    ]


def test_activate_runs_a_crashed_orphaned_flow_run_again(store, monkeypatch):
    """The describe line's ``det experiment activate`` for an experiment whose flow died:
    its Crashed flow run is scheduled again (Prefect's Retry), under the same id; one that
    Crashed for another reason (its MLflow runs not ORPHANED) is refused."""
    client, _ = store
    orphan, _ = _experiment(client, beat_age_s=600, state="ORPHANED")
    failed, _ = _experiment(client, beat_age_s=600, state="ERROR")
    proposed: list[tuple[str, str, str]] = []
    monkeypatch.setattr(
        lifecycle.prefect_rest, "read_flow_run", lambda run_id: _flow_run(str(run_id), "CRASHED", 9)
    )
    monkeypatch.setattr(
        lifecycle.prefect_rest,
        "set_flow_run_state",
        lambda run_id, kind, name, message, force=False: (
            proposed.append((str(run_id), kind, name)) or "ACCEPT"
        ),
    )
    assert "runs again" in lifecycle.activate(orphan)
    assert proposed == [(orphan, "SCHEDULED", "AwaitingRetry")]
    with pytest.raises(Exception, match="is ERROR, not paused"):
        lifecycle.activate(failed)
    assert len(proposed) == 1
