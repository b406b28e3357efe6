"""Experiment lifecycle verbs on the stack: Determined's pause, activate, cancel and kill.

An experiment is keyed by the id of the flow run that created it (its MLflow parent run
carries that key). The verbs act through the engines that already run it:
- pause, cancel, kill: a stop request under ``["det-tasks-stop", KEY]`` in the Dask
  scheduler's metadata (``Client.set_metadata``); the running flow reads it within about a
  second and stops every trial at its next batch boundary (pause and cancel checkpoint
  there, kill does not; flows.stopping);
- a paused experiment's flow run is *suspended* in Prefect (Prefect's own pause for a
  deployment run, which frees the worker and its process); activate resumes it
  (``resume_flow_run``), so the same flow run, MLflow runs, trial ids and searcher state go
  on, each trial from its pause checkpoint. The Prefect UI's Resume button does the same.
- cancelling a paused experiment needs no worker: its flow run is set Cancelled and its
  MLflow runs say CANCELED.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import uuid
from pathlib import Path
from typing import Any

from cluster.environment import SCHEDULER_ENV, stack_scheduler
from cluster.job_requests import forget_job
from cluster.stop_requests import STOP_STATES, request_stop_at
from det_tasks.errors import DetTasksError
from flows import prefect_rest
from flows.prefect_rest import FlowRun

__all__ = [
    "activate",
    "cancel",
    "kill",
    "pause",
    "continue_lines",
    "reschedule",
    "settle_dead_flow_run",
    "settle_dead_holders",
]

# Prefect's state types, as its REST API spells them.
_ACTIVE = {"RUNNING", "PENDING", "SCHEDULED"}
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def pause(experiment_key: str) -> str:
    """Pause a running experiment: its trials checkpoint and free their workers; one line."""
    run = _flow_run(experiment_key)
    _require_active(run, "paused")
    _request(experiment_key, "pause")
    return (
        f"Pausing experiment {experiment_key[:8]}: its trials checkpoint at their next batch "
        f"boundary (det experiment activate {experiment_key[:8]} continues it)"
    )


def activate(experiment_key: str) -> str:
    """Continue a paused experiment where it stopped, or one whose flow died (its flow run
    settled Crashed, its MLflow runs ORPHANED: the flow run runs again); one line."""
    run = _flow_run(experiment_key)
    if run.state == "CRASHED" and _orphaned_in_mlflow(experiment_key):
        reschedule(run.id, f"experiment {experiment_key[:8]} activated after its flow died")
        return f"Activated experiment {experiment_key[:8]} (its flow had died: it runs again)"
    if run.state != "PAUSED":
        from registry.experiments.activation import already_active, not_activatable

        short, state = experiment_key[:8], prefect_rest.experiment_state(run.state)
        if run.state in _ACTIVE or run.state == "CANCELLING":
            raise DetTasksError(already_active(short, state))
        raise DetTasksError(
            not_activatable(short, state, "create a new one with det experiment create")
        )
    prefect_rest.resume_flow_run(run.id)
    return f"Activated experiment {experiment_key[:8]}"


def cancel(experiment_key: str) -> str:
    """Cancel: running trials checkpoint at their next batch boundary and end; one line."""
    return _stop(experiment_key, "cancel")


def kill(experiment_key: str) -> str:
    """Kill: running trials stop at their next batch boundary, without a checkpoint."""
    return _stop(experiment_key, "kill")


def _stop(experiment_key: str, mode: str) -> str:
    run = _flow_run(experiment_key)
    short = experiment_key[:8]
    if run.state == "PAUSED":  # nothing runs: end it where it is recorded
        from registry.runs.run_states import mark_experiment_state

        message = f"experiment {short} {mode}ed while paused"
        prefect_rest.set_flow_run_state(run.id, "CANCELLED", "Cancelled", message, force=True)
        mark_experiment_state(experiment_key, STOP_STATES[mode])
        _forget_job(experiment_key)
        return f"Experiment {short} was paused; it is now CANCELED"
    _require_active(run, "canceled" if mode == "cancel" else "killed")
    _request(experiment_key, mode)
    how = "checkpoint and end" if mode == "cancel" else "end without a checkpoint"
    doing = "Canceling" if mode == "cancel" else "Killing"
    return f"{doing} experiment {short}: its trials {how} at their next batch boundary"


def _forget_job(experiment_key: str) -> None:
    """A paused experiment ended: off the job queue's list (where a scheduler is named)."""
    address = os.environ.get(SCHEDULER_ENV)
    if address:
        with contextlib.suppress(OSError):
            forget_job(address, experiment_key)


def _flow_run(experiment_key: str) -> FlowRun:
    try:
        flow_run_id = uuid.UUID(experiment_key)
    except ValueError:
        raise DetTasksError(
            f"{experiment_key!r} is not an experiment key (the flow-run id it was created as)"
        ) from None
    return prefect_rest.read_flow_run(flow_run_id)


def _require_active(run: FlowRun, verb: str) -> None:
    short = str(run.id)[:8]
    if run.state == "CANCELLING":
        raise DetTasksError(f"experiment {short} is already being canceled")
    if run.state == "PAUSED":
        raise DetTasksError(f"experiment {short} is paused already: nothing runs to be {verb}")
    if run.state in _FINAL:
        state = prefect_rest.experiment_state(run.state)
        raise DetTasksError(
            f"experiment {short} is {state}: only an active experiment can be {verb}"
        )


def _request(experiment_key: str, mode: str) -> None:
    """Leave the stop request where the experiment's flow reads it: the stack's scheduler
    (cluster.stop_requests), through one RPC, without a Dask client of its own."""
    with stack_scheduler(
        "pause, cancel and kill reach an experiment through the stack's Dask scheduler "
        "(source .stack/env after make up); an experiment run with python -m flows.experiment "
        "stops with Ctrl-C in its terminal"
    ) as address:
        before = request_stop_at(address, experiment_key, mode)
    if before == mode:
        raise DetTasksError(f"experiment {experiment_key[:8]}: {mode} was already requested")


# ---- a holder that died (make down, a SIGKILLed flow, a lost host) ----------------------
DEAD_HOLDER = (
    "its flow stopped without a word (a stopped stack, a killed process or a lost host); "
    "its MLflow runs are ORPHANED"
)


def reschedule(flow_run_id: uuid.UUID | str, message: str) -> None:
    """Run a finished deployment flow run again (Prefect's own Retry: AwaitingRetry): the
    worker starts it with its parameters, under the same id, so the same experiment key."""
    answer = prefect_rest.set_flow_run_state(
        flow_run_id, "SCHEDULED", "AwaitingRetry", message, force=True
    )
    if answer and answer != "ACCEPT":
        raise DetTasksError(
            f"the Prefect server did not schedule flow run {flow_run_id} again ({answer})"
        )


def settle_dead_flow_run(experiment_key: str, why: str = DEAD_HOLDER) -> bool:
    """End the Prefect flow run of an experiment whose flow is known gone (Crashed, which
    ``det`` shows as ERROR), so Prefect agrees with MLflow; True when it was still active.
    Quiet where there is no flow run of that id (an embedded run's server is gone)."""
    try:
        run = _flow_run(experiment_key)
    except DetTasksError:
        return False
    if run.state not in _ACTIVE and run.state != "CANCELLING":
        return False
    prefect_rest.set_flow_run_state(run.id, "CRASHED", "Crashed", why, force=True)
    return True


def settle_dead_holders(reader: Any, runs: list[FlowRun]) -> list[str]:
    """``det experiment list/describe/continue``: every flow run among ``runs`` that Prefect
    holds Running although its flow is gone is ended Crashed (MLflow's side first: its
    RUNNING runs end ORPHANED); returns their keys. Gone: its MLflow parent says ORPHANED,
    or its flow's heartbeat is stale or its process dead (registry.runs.run_records.orphaned),
    and it has been Running for longer than a heartbeat may take (a flow run just started
    again by activate or continue has not beaten yet: it is given three times as long)."""
    from registry.experiments.view import find_parent
    from registry.runs.run_records import HEARTBEAT_TAG, ORPHAN_AFTER_S, STATE_TAG, orphaned

    settled = []
    now = datetime.datetime.now(datetime.UTC)
    for run in runs:
        if run.state not in ("RUNNING", "CANCELLING") or run.state_since is None:
            continue
        found = find_parent(reader, str(run.id))
        if found is None:
            continue
        parent = found[0]
        beat = float(parent.data.tags.get(HEARTBEAT_TAG) or 0)
        # A flow that has not beaten since it started (a slow start) gets three times longer.
        patience = ORPHAN_AFTER_S * (3 if beat < run.state_since.timestamp() else 1)
        if (now - run.state_since).total_seconds() <= patience:
            continue
        if parent.data.tags.get(STATE_TAG) != "ORPHANED" and not orphaned(parent):
            continue
        if parent.info.status == "RUNNING":
            from registry.cli import end_orphans_seen

            end_orphans_seen(reader)
        if settle_dead_flow_run(str(run.id)):
            settled.append(str(run.id))
    return settled


def _orphaned_in_mlflow(experiment_key: str) -> bool:
    from registry.cli import tracking_reader_from_env
    from registry.experiments.view import find_parent
    from registry.runs.run_records import STATE_TAG

    found = find_parent(tracking_reader_from_env(), experiment_key)
    return found is not None and found[0].data.tags.get(STATE_TAG) == "ORPHANED"


def continue_lines(
    client: Any, experiment_id: str, run_key: str, command: tuple[Path, list[str]] | None
) -> list[str]:
    """What a new run of an experiment's config says about earlier runs of it whose flow
    died (found by registry.runs.run_states.stopped_short): where each stopped and the exact
    command that continues it. ``command``: the config and overrides this run was started
    with (``python -m flows.experiment``), None on the stack (``det``). Their Prefect flow
    runs, where this server has them, are settled Crashed on the way."""
    from registry.runs.run_states import stopped_short

    lines = []
    for key, batch in stopped_short(client, experiment_id, run_key):
        with contextlib.suppress(Exception):  # an embedded run's server may be long gone
            settle_dead_flow_run(key)
        if command is None:
            how = f"det experiment activate {key[:8]}"
        else:
            typed = shlex.join([str(command[0]), *command[1]])
            how = f"python -m flows.experiment {typed} --activate {key}"
        lines.append(
            f"experiment {key[:8]} of this config stopped at batch {batch} without finishing; "
            f"continue it with: {how}"
        )
    return lines
