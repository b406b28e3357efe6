"""How an experiment's MLflow runs end when it is stopped rather than finished, and how runs
whose flow died without a word (SIGKILL, a lost host) are found and ended.

A flow stamps its parent run with a heartbeat (``det.heartbeat``, epoch seconds) while it
runs. A RUNNING parent whose heartbeat is older than ``ORPHAN_AFTER_S`` has no flow behind
it: ``end_orphans`` marks it and its RUNNING trial runs KILLED (``det.state`` ORPHANED).
Every experiment start and every ``det experiment list`` sweeps, so an orphan is ended by
the next command that looks, and never shows RUNNING for longer than that. Each beat also
names the process (``det.flow_process``), so an activation on the same host can tell at
once that a SIGKILLed flow is gone (``flow_gone``) instead of waiting for the beat to age.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import psutil
from mlflow.entities import RunTag

from registry.runs.tracking import (
    ERROR_TAG,
    EXPERIMENT_RUN_TAG,
    HEARTBEAT_TAG,
    PARENT_TAG,
    STATE_TAG,
    TRIAL_TAG,
    client_for,
    retry_mlflow,
)
from registry.servers.settings import RegistrySettings

__all__ = [
    "FLOW_PROCESS_TAG",
    "ORPHAN_AFTER_S",
    "end_orphans",
    "end_running_runs",
    "flow_gone",
    "heartbeat",
    "record_failure",
    "mark_experiment_state",
    "stopped_short",
    "this_process",
]

# The flow beats every HEARTBEAT_S; three missed beats mean nobody is behind the run.
HEARTBEAT_S = 15.0
ORPHAN_AFTER_S = 60.0
FLOW_PROCESS_TAG = "det.flow_process"  # which process beats (this_process)


def heartbeat(client: Any, parent_run_id: str, now: float | None = None) -> None:
    """Say the experiment's flow is alive, and which process it is (one write)."""
    beat = f"{time.time() if now is None else now:.0f}"
    tags = [RunTag(HEARTBEAT_TAG, beat), RunTag(FLOW_PROCESS_TAG, this_process())]
    client.log_batch(parent_run_id, tags=tags)


def this_process() -> str:
    """``host pid start-time``: names this process apart from a later one given its pid."""
    started = psutil.Process(os.getpid()).create_time()
    return f"{socket.gethostname()} {os.getpid()} {started:.2f}"


def flow_gone(parent: Any) -> bool:
    """Whether the process that last beat for a RUNNING parent run is known to be gone: it
    ran on this host, and no process with its pid and start time runs now (a SIGKILLed
    flow, before its heartbeat goes stale). False when it ran elsewhere or is unknown."""
    host, _, rest = (parent.data.tags.get(FLOW_PROCESS_TAG) or "").partition(" ")
    pid_text, _, started = rest.partition(" ")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        alive = psutil.Process(int(pid_text)).create_time()
    except psutil.NoSuchProcess:  # zombies too
        return True
    except psutil.Error:  # not ours to see: it may be alive
        return False
    return f"{alive:.2f}" != started


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
        retry_mlflow(lambda rid=run_id: client.set_terminated(rid, status=status))
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
    """End every experiment run in ``experiment_ids`` whose flow stopped beating, or whose
    flow process on this host is gone (a ``timeout -k`` or OOM SIGKILL: ended by the next
    look, not a minute later); returns their parent run ids."""
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
        if now - beat > ORPHAN_AFTER_S or flow_gone(parent):
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


def stopped_short(client: Any, experiment_id: str, keep_key: str) -> list[tuple[str, int]]:
    """The experiment runs of MLflow experiment ``experiment_id`` whose flow died (ORPHANED)
    and that nobody has continued since, newest first, each with the furthest batch one of
    its trials reached: what the next run of the same command tells the user about.
    ``keep_key``: the run asking (never itself)."""
    parents = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{STATE_TAG}` = 'ORPHANED' and tags.`{HEARTBEAT_TAG}` != ''",
        order_by=["attributes.start_time DESC"],
        max_results=20,
    )
    found = []
    for parent in parents:
        key = parent.data.tags.get(EXPERIMENT_RUN_TAG)
        if not key or key == keep_key:
            continue
        trials = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
            max_results=10000,
        )
        reached = [int(t.data.metrics.get("progress/batches", 0)) for t in trials]
        found.append((key, max(reached, default=0)))
    return found
