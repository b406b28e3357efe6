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

import os
import uuid

from distributed import Client
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.flow_runs import resume_flow_run
from prefect.states import Cancelled

from det_tasks.errors import DetTasksError
from flows.engine import SCHEDULER_ENV
from flows.stopping import STOP_STATES, stop_metadata_key
from registry.activation import already_active, not_activatable
from registry.run_states import mark_experiment_state

__all__ = ["activate", "cancel", "kill", "pause"]

_ACTIVE = {StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED}
_FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED}


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
    """Continue a paused experiment where it stopped; one line."""
    run = _flow_run(experiment_key)
    state = _state(run)
    if state != StateType.PAUSED:
        short = experiment_key[:8]
        if state in _ACTIVE or state == StateType.CANCELLING:
            raise DetTasksError(already_active(short, state.value))
        raise DetTasksError(
            not_activatable(short, state.value, "create a new one with det experiment create")
        )
    resume_flow_run(run.id)
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
    if _state(run) == StateType.PAUSED:  # nothing runs: end it where it is recorded
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(
                run.id, Cancelled(message=f"experiment {short} {mode}ed while paused"), force=True
            )
        mark_experiment_state(experiment_key, STOP_STATES[mode])
        return f"Experiment {short} was paused; it is now CANCELED"
    _require_active(run, "cancelled" if mode == "cancel" else "killed")
    _request(experiment_key, mode)
    how = "checkpoint and end" if mode == "cancel" else "end without a checkpoint"
    return (
        f"{mode.capitalize()}ing experiment {short}: its trials {how} at their next batch boundary"
    )


def _flow_run(experiment_key: str) -> FlowRun:
    try:
        flow_run_id = uuid.UUID(experiment_key)
    except ValueError:
        raise DetTasksError(
            f"{experiment_key!r} is not an experiment key (the flow-run id it was created as)"
        ) from None
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _state(run: FlowRun) -> StateType:
    return run.state.type if run.state else StateType.PENDING


def _require_active(run: FlowRun, verb: str) -> None:
    state = _state(run)
    short = str(run.id)[:8]
    if state == StateType.CANCELLING:
        raise DetTasksError(f"experiment {short} is already being cancelled")
    if state == StateType.PAUSED:
        raise DetTasksError(f"experiment {short} is paused already: nothing runs to be {verb}")
    if state in _FINAL:
        raise DetTasksError(
            f"experiment {short} is {state.value}: only an active experiment can be {verb}"
        )


def _request(experiment_key: str, mode: str) -> None:
    """Leave the stop request where the experiment's flow reads it: the stack's scheduler."""
    address = os.environ.get(SCHEDULER_ENV)
    if not address:
        raise DetTasksError(
            f"{SCHEDULER_ENV} is not set: pause, cancel and kill reach an experiment through "
            "the stack's Dask scheduler (source .stack/env after make up); an experiment run "
            "with python -m flows.experiment stops with Ctrl-C in its terminal"
        )
    try:
        with Client(address, timeout=10, set_as_default=False) as client:
            key = stop_metadata_key(experiment_key)
            if client.get_metadata(key, None) == mode:
                raise DetTasksError(
                    f"experiment {experiment_key[:8]}: {mode} was already requested"
                )
            client.set_metadata(key, mode)
    except OSError as err:
        raise DetTasksError(
            f"cannot reach the Dask scheduler at {address} ({err}): is the stack up (make up)?"
        ) from None
