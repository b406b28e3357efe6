"""How an experiment's MLflow runs end when it is stopped rather than finished, and how runs
whose flow died without a word (SIGKILL, a lost host) are found and ended.

A flow stamps its parent run with a heartbeat (``det.heartbeat``, epoch seconds) while it
runs. A RUNNING parent whose heartbeat is older than ``ORPHAN_AFTER_S`` has no flow behind
it: ``end_orphans`` marks it and its RUNNING trial runs KILLED (``det.state`` ORPHANED).
Every experiment start and every ``det experiment list`` sweeps, so an orphan is ended by
the next command that looks, and never shows RUNNING for longer than that.
"""

from __future__ import annotations

import time
from typing import Any

from registry.settings import RegistrySettings
from registry.tracking import (
    ERROR_TAG,
    EXPERIMENT_RUN_TAG,
    HEARTBEAT_TAG,
    PARENT_TAG,
    STATE_TAG,
    TRIAL_TAG,
    _retry,
    client_for,
)

__all__ = [
    "ORPHAN_AFTER_S",
    "end_orphans",
    "end_running_runs",
    "heartbeat",
    "record_failure",
    "mark_experiment_state",
]

# The flow beats every HEARTBEAT_S; three missed beats mean nobody is behind the run.
HEARTBEAT_S = 15.0
ORPHAN_AFTER_S = 60.0


def heartbeat(client: Any, parent_run_id: str, now: float | None = None) -> None:
    """Say the experiment's flow is alive (one tag write)."""
    client.set_tag(parent_run_id, HEARTBEAT_TAG, f"{time.time() if now is None else now:.0f}")


def end_running_runs(
    client: Any, experiment_id: str, parent_run_id: str, state: str, status: str = "KILLED"
) -> int:
    """End the parent and every trial run of it still RUNNING: ``status`` (KILLED for a
    stop, FAILED for an error), ``det.state`` = ``state``. Returns how many runs it ended."""
    trials = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and attributes.status = 'RUNNING'",
        max_results=10000,
    )
    ended = 0
    for run_id in [t.info.run_id for t in trials] + [parent_run_id]:
        run = client.get_run(run_id)
        if run.info.status != "RUNNING":
            continue
        client.set_tag(run_id, STATE_TAG, state)
        _retry(lambda rid=run_id: client.set_terminated(rid, status=status))
        ended += 1
    return ended


def record_failure(
    client: Any, experiment_id: str, parent_run_id: str, text: str, trial_id: int | None = None
) -> None:
    """Say on the parent run (and on trial ``trial_id``'s run, whatever its worker wrote
    there) why the experiment failed, in the words the user reads on the terminal."""
    run_ids = [parent_run_id]
    if trial_id is not None:
        trials = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and "
            f"tags.`{TRIAL_TAG}` = '{trial_id}'",
            max_results=10,
        )
        run_ids += [t.info.run_id for t in trials]
    for run_id in run_ids:
        client.set_tag(run_id, ERROR_TAG, text[:5000])
        client.set_tag(run_id, STATE_TAG, "ERROR")


def end_orphans(client: Any, experiment_ids: list[str], now: float | None = None) -> list[str]:
    """End every experiment run in ``experiment_ids`` whose flow stopped beating; returns
    their parent run ids."""
    if not experiment_ids:
        return []
    now = time.time() if now is None else now
    parents = client.search_runs(
        experiment_ids,
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HEARTBEAT_TAG}` != ''",
        max_results=1000,
    )
    ended = []
    for parent in parents:
        beat = float(parent.data.tags.get(HEARTBEAT_TAG) or 0)
        if now - beat > ORPHAN_AFTER_S:
            end_running_runs(client, parent.info.experiment_id, parent.info.run_id, "ORPHANED")
            ended.append(parent.info.run_id)
    return ended


def mark_experiment_state(experiment_key: str, state: str) -> int:
    """Record ``state`` on a stopped experiment's parent run and on its trial runs that
    ended KILLED (a paused experiment cancelled: nothing runs to do it); the count."""
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        return 0
    client = client_for(settings.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(
        experiments, filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{experiment_key}'"
    )
    marked = 0
    for parent in parents:
        trials = client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
            max_results=10000,
        )
        for run in [parent, *trials]:
            if run.info.status in ("KILLED", "RUNNING"):
                client.set_tag(run.info.run_id, STATE_TAG, state)
                if run.info.status == "RUNNING":
                    client.set_terminated(run.info.run_id, status="KILLED")
                marked += 1
    return marked
