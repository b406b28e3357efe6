"""Runs whose flow died without a word (SIGKILL of the flow's process, a lost host) are found
by their stale heartbeat and ended KILLED with det.state ORPHANED; a live experiment's runs
are left alone. Real MLflow (a local SQLite store)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def test_a_parent_without_heartbeat_for_a_minute_is_ended_with_its_trials(tmp_path: Path):
    pytest.importorskip("mlflow")
    from registry.runs.run_states import ORPHAN_AFTER_S, end_orphans, heartbeat
    from registry.runs.tracking import PARENT_TAG, client_for

    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("orphans", artifact_location=tmp_path.as_uri())
    now = time.time()

    def experiment(last_beat: float) -> tuple[str, str]:
        parent = client.create_run(experiment_id).info.run_id
        heartbeat(client, parent, now=last_beat)
        trial = client.create_run(experiment_id, tags={PARENT_TAG: parent}).info.run_id
        return parent, trial

    dead = experiment(now - ORPHAN_AFTER_S - 5)
    alive = experiment(now - ORPHAN_AFTER_S + 30)

    assert end_orphans(client, [experiment_id], now=now) == [dead[0]]
    for run_id in dead:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time is not None
        assert run.data.tags["det.state"] == "ORPHANED"
    assert {client.get_run(r).info.status for r in alive} == {"RUNNING"}
    assert end_orphans(client, [experiment_id], now=now) == []  # ended once


def test_a_fresh_heartbeat_from_a_process_that_is_gone_is_ended_at_the_next_look(
    tmp_path: Path,
):
    """``timeout -k`` or the OOM killer SIGKILLs the flow right after a beat: the next look
    on this host sees its process gone and ends the runs, without waiting a minute."""
    pytest.importorskip("mlflow")
    import subprocess
    import sys

    from mlflow.entities import RunTag

    from registry.runs.run_states import FLOW_PROCESS_TAG, end_orphans, heartbeat
    from registry.runs.tracking import PARENT_TAG, client_for

    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("gone", artifact_location=tmp_path.as_uri())
    parent = client.create_run(experiment_id).info.run_id
    trial = client.create_run(experiment_id, tags={PARENT_TAG: parent}).info.run_id
    code = "from registry.runs.run_states import this_process; print(this_process())"
    gone = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()  # a process that has exited by now
    heartbeat(client, parent)  # beats now...
    client.log_batch(parent, tags=[RunTag(FLOW_PROCESS_TAG, gone)])  # ...as that process
    assert end_orphans(client, [experiment_id]) == [parent]
    for run_id in (parent, trial):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags["det.state"] == "ORPHANED"
