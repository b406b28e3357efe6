"""Which experiment runs may be activated (continued), in Determined's rule: only one that
stopped short. Asked before ``python -m flows.experiment CONFIG --activate KEY`` starts
anything, and again by the flow when given an ``experiment_key``.

The experiment run's MLflow parent run says what happened to it, wherever it ran (an
embedded run's Prefect flow run is Cancelled when it pauses, and its Prefect server is
gone): PAUSED (Ctrl-C, ``det experiment pause``) and ORPHANED (its flow died without a
word; a RUNNING parent whose flow is known gone counts too) continue; a RUNNING one with a
live flow is already active; COMPLETED, CANCELED and ERROR ones have ended.

A failed activation changes nothing: when an activated experiment fails before any of its
trials got past where it stopped (a checkpoint that no longer fits the model, an import
error in changed code), its runs go back to what they were (``before_activation`` /
``back_to_paused``): PAUSED with the pause checkpoints, the code snapshot it had, and the
failure kept in ``det.activation_error``, so the same line can activate it again once
the cause is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from det_tasks.errors import DetTasksError
from det_tasks.home import det_tasks_home, no_server_recording
from registry.experiments.code_snapshot import snapshot_tags
from registry.runs.run_records import CHECKPOINT_TAG
from registry.runs.run_states import HEARTBEAT_TAG, ORPHAN_AFTER_S, flow_gone
from registry.runs.tracking import ERROR_TAG, EXPERIMENT_RUN_TAG, PARENT_TAG, STATE_TAG, client_for
from registry.runs.trial_states import ORPHANED, PAUSED, RUNNING, trial_state

__all__ = [
    "ACTIVATABLE",
    "ACTIVATION_ERROR_TAG",
    "RunBefore",
    "activation_progressed",
    "already_active",
    "back_to_paused",
    "before_activation",
    "check_activatable",
    "check_activation",
    "experiment_run_state",
    "not_activatable",
    "recording_store",
    "store_errors",
]

ACTIVATABLE = frozenset({PAUSED, ORPHANED})
ACTIVATION_ERROR_TAG = "det.activation_error"
PROGRESS_METRIC = "progress/batches"


def already_active(short: str, how: str) -> str:
    """The refusal for an experiment that runs (``how``: what says so)."""
    return f"experiment {short} is already active ({how})"


def not_activatable(short: str, state: str, start_new: str) -> str:
    """The refusal for an experiment that ended (``start_new``: how to start another)."""
    return (
        f"experiment {short} is {state}, not paused: only a paused experiment can be "
        f"activated ({start_new})"
    )


def experiment_run_state(parent: Any, now: float | None = None) -> str:
    """The state of the experiment run whose MLflow parent run is ``parent``: its
    ``det.state`` word, ORPHANED for a RUNNING one whose flow is gone (heartbeat older
    than ORPHAN_AFTER_S, or its process, on this host, no longer running)."""
    state = trial_state(parent.info.status, parent.data.tags.get(STATE_TAG))
    if state != RUNNING:
        return state
    now = time.time() if now is None else now
    beat = parent.data.tags.get(HEARTBEAT_TAG)
    last = float(beat) if beat else parent.info.start_time / 1000
    return ORPHANED if now - last > ORPHAN_AFTER_S or flow_gone(parent) else RUNNING


def check_activation(experiment_name: str, experiment_key: str) -> None:
    """``check_activatable`` against the MLflow store this process records to, creating
    nothing (``recording_store``)."""
    _refuse_malformed(experiment_key)
    advice = "; leave --activate out to start a new experiment"
    uri = recording_store("--activate", experiment_key, advice)
    with store_errors("--activate", experiment_key, uri):
        check_activatable(client_for(uri), experiment_name, experiment_key, uri)


def recording_store(flag: str, experiment_key: str, advice: str = "") -> str:
    """The MLflow store this process records to (MLFLOW_TRACKING_URI, else the embedded
    mode's in the det_tasks home), for ``flag KEY``: a SQLite store that does not exist
    yet holds no experiment, which is said in one line (with ``advice``), creating nothing."""
    home_store = no_server_recording(det_tasks_home())["MLFLOW_TRACKING_URI"]
    uri = os.environ.get("MLFLOW_TRACKING_URI") or home_store
    database = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///") and not Path(database).is_file():
        raise DetTasksError(
            f"{flag} {experiment_key}: no experiment run has this key: MLflow's store "
            f"{database} does not exist{advice}"
        )
    return uri


@contextlib.contextmanager
def store_errors(flag: str, experiment_key: str, uri: str) -> Iterator[None]:
    """A store that cannot be read (unreachable server, refused credentials, a broken
    database) in one line for ``flag KEY``; the user's own refusals pass as they are."""
    try:
        yield
    except DetTasksError:
        raise
    except Exception as err:
        raise DetTasksError(
            f"{flag} {experiment_key}: cannot read MLflow at {uri} "
            f"({type(err).__name__}: {err}); is it up and MLFLOW_TRACKING_URI right?"
        ) from None


def check_activatable(
    client: Any, experiment_name: str, experiment_key: str, where: str, now: float | None = None
) -> None:
    """Raise DetTasksError, in one line, unless the experiment run ``experiment_key`` of
    MLflow experiment ``experiment_name`` may continue (``where``: the tracking store)."""
    short = experiment_key[:8]
    _refuse_malformed(experiment_key)
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    parents = (
        client.search_runs(
            list(experiments),
            filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{experiment_key}'",
            max_results=1,
        )
        if experiments
        else []
    )
    if not parents:
        raise DetTasksError(
            f"--activate {experiment_key}: no experiment run has this key in MLflow at "
            f"{where}: give the key a paused run printed, or leave --activate out to start "
            "a new experiment"
        )
    parent = parents[0]
    found_in = experiments.get(parent.info.experiment_id, "?")
    if found_in != experiment_name:
        raise DetTasksError(
            f"--activate {experiment_key}: that experiment run is in MLflow experiment "
            f"{found_in!r}, not {experiment_name!r} (this config's name): activate it with "
            "the config it ran with"
        )
    state = experiment_run_state(parent, now)
    if state == RUNNING:
        beat = parent.data.tags.get(HEARTBEAT_TAG)
        age = f"its flow beat {max(0.0, (now or time.time()) - float(beat)):.0f} s ago"
        raise DetTasksError(already_active(short, age if beat else "its run is RUNNING"))
    if state not in ACTIVATABLE:
        raise DetTasksError(
            not_activatable(short, state, "leave --activate out to start a new experiment")
        )


def _refuse_malformed(experiment_key: str) -> None:
    if not _is_key(experiment_key):
        raise DetTasksError(
            f"--activate {experiment_key!r}: an experiment key is the UUID a paused run "
            "printed (e.g. 0f8c2d1e-...): give that, or leave --activate out to start a new "
            "experiment"
        )


def _is_key(text: str) -> bool:
    """Whether ``text`` is an experiment key as the flow makes one (a UUID, as printed)."""
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class RunBefore:
    """One run of an experiment as it was before an activation: what to put back."""

    run_id: str
    status: str
    state: str | None
    error: str | None
    code: dict[str, str]
    progress: float | None
    checkpoints: int


def before_activation(client: Any, experiment_id: str, parent_run_id: str) -> list[RunBefore]:
    """The parent run and its trial runs as they are now, before an activation."""
    trials = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        max_results=10000,
    )
    return [_as_before(run) for run in [client.get_run(parent_run_id), *trials]]


def _as_before(run: Any) -> RunBefore:
    tags = run.data.tags
    return RunBefore(
        run_id=run.info.run_id,
        status=run.info.status,
        state=tags.get(STATE_TAG),
        error=tags.get(ERROR_TAG),
        code=snapshot_tags(run),
        progress=run.data.metrics.get(PROGRESS_METRIC),
        checkpoints=sum(1 for name in tags if name.startswith(CHECKPOINT_TAG)),
    )


def activation_progressed(client: Any, before: list[RunBefore]) -> bool:
    """Whether any trial got past where the experiment stopped since ``before``: a new
    checkpoint or training progress recorded (then a failure is the run's own, not the
    activation's)."""
    for was in before:
        now = _as_before(client.get_run(was.run_id))
        if now.checkpoints != was.checkpoints or now.progress != was.progress:
            return True
    return False


def back_to_paused(client: Any, before: list[RunBefore], why: str) -> None:
    """Put every run back as it was before a failed activation (status, ``det.state``,
    error and code snapshot tags), and say why the activation failed on each."""
    for was in before:
        run = client.get_run(was.run_id)
        if run.info.status != was.status:
            client.set_terminated(was.run_id, status=was.status)
        _put_tag(client, was.run_id, STATE_TAG, was.state, run.data.tags)
        _put_tag(client, was.run_id, ERROR_TAG, was.error, run.data.tags)
        for name in ("det.code_package", "det.code_version", "det.code_versions"):
            _put_tag(client, was.run_id, name, was.code.get(name), run.data.tags)
        client.set_tag(was.run_id, ACTIVATION_ERROR_TAG, why[:5000])


def _put_tag(client: Any, run_id: str, name: str, value: str | None, now: dict[str, str]) -> None:
    if value is not None and now.get(name) != value:
        client.set_tag(run_id, name, value)
    elif value is None and name in now:
        client.delete_tag(run_id, name)
