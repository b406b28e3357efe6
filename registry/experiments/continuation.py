"""``det experiment continue`` (Determined's verb): which experiment runs may continue, from
where, and the records changed so that the flow's activation path carries them on.

Determined 0.38.1's master continues an experiment in a terminal state (COMPLETED, CANCELED,
ERROR); with a changed config only a single-searcher one, and the override must keep the
single searcher. It puts the experiment and its trial back in PAUSED and activates it: the
same experiment and trial go on from the trial's latest checkpoint. The same here: the MLflow
parent and trial runs are marked PAUSED (KILLED), the trial's result is taken out of the
searcher's saved state (so the flow trains it again, to the new length), the active config is
recorded, and then the flow's activation (``--activate``, or the stack's flow run scheduled
again) does the rest. A run whose flow died (ORPHANED) continues the same way; a PAUSED one
too (that is activate with, possibly, a new length). Multi-trial searches are refused: an
orphaned or paused one continues with activate, which keeps the searcher's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from typing import Any

from det_tasks.config import ExperimentConfig
from det_tasks.errors import DetTasksError
from registry.checkpoints.store import checkpoint_records
from registry.experiments.activation import (
    already_active,
    experiment_run_state,
    recording_store,
    store_errors,
)
from registry.experiments.view import find_parent, trial_runs_of
from registry.runs.large_tags import large_tag
from registry.runs.searcher_state import load_searcher_state, save_searcher_state
from registry.runs.tracking import (
    CONFIG_TAG,
    ERROR_TAG,
    STATE_TAG,
    client_for,
    experiment_config,
    retry_mlflow,
)
from registry.runs.trial_states import CANCELED, COMPLETED, ERROR, ORPHANED, PAUSED, RUNNING

__all__ = [
    "CONTINUABLE",
    "Continuation",
    "NothingToContinue",
    "apply_continuation",
    "continue_in_store",
    "plan_continuation",
]

CONTINUABLE = frozenset({COMPLETED, ERROR, CANCELED, ORPHANED, PAUSED})


class NothingToContinue(DetTasksError):
    """The trial already trained the length asked for: continuing would change nothing."""


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What a continue will do: which runs, from which batch, to which length."""

    experiment_key: str
    experiment_id: str
    experiment_name: str  # the MLflow experiment's (the config's name)
    parent_run_id: str
    trial_run_id: str | None  # None: the trial never started (a failure before it)
    state: str  # the state it continues from
    resumes_at: int  # the trial's newest checkpoint (0: none, it starts over)
    length: str  # searcher.max_length as the config now says it, e.g. "200 batches"

    def summary(self) -> str:
        where = (
            f"its newest checkpoint, batch {self.resumes_at}"
            if self.resumes_at
            else "batch 0 (no checkpoint)"
        )
        short = self.experiment_key[:8]
        return f"experiment {short} ({self.state}) continues from {where} to {self.length}"


def plan_continuation(
    client: Any, experiment_key: str, cfg: ExperimentConfig, now: float | None = None
) -> Continuation:
    """Check that the experiment run ``experiment_key`` may continue with config ``cfg``
    (its config with the overrides applied); DetTasksError in one line if not."""
    short = experiment_key[:8]
    try:
        uuid.UUID(experiment_key)
    except ValueError:
        raise DetTasksError(
            f"{experiment_key!r} is not an experiment key (the UUID its run printed)"
        ) from None
    found = find_parent(client, experiment_key)
    if found is None:
        raise DetTasksError(
            f"experiment {short} has no MLflow runs (it never started a trial): nothing to "
            "continue; create it again"
        )
    parent, experiment_name = found
    state = experiment_run_state(parent, now)
    if state == RUNNING:
        raise DetTasksError(already_active(short, "its run is RUNNING") + ": nothing to continue")
    if state not in CONTINUABLE:
        raise DetTasksError(
            f"experiment {short} is {state}: only a COMPLETED, CANCELED, ERROR, orphaned or "
            "paused experiment can be continued"
        )
    trials = trial_runs_of(client, parent)
    _refuse_search(short, experiment_config(parent.data.tags), len(trials), state)
    if cfg.searcher.name != "single":
        raise DetTasksError(
            f"experiment {short}: the continued config's searcher.name is "
            f"{cfg.searcher.name!r}; a continued single-trial experiment keeps searcher.name: "
            "single (change only its max_length, or create a new experiment)"
        )
    trial = trials[0] if trials else None
    records = checkpoint_records(client, trial.info.run_id) if trial else []
    newest = max((int(r["steps_completed"]) for r in records), default=0)
    length = "the length its script's fit() sets"
    if cfg.has_max_length:
        length = f"{cfg.max_length.value} {cfg.max_length.unit}"
        if cfg.max_length.unit == "batches":
            _check_length(short, state, newest, cfg.max_length.value)
    return Continuation(
        experiment_key,
        parent.info.experiment_id,
        experiment_name,
        parent.info.run_id,
        trial.info.run_id if trial else None,
        state,
        newest,
        length,
    )


def _check_length(short: str, state: str, newest: int, batches: int) -> None:
    """A length below the trained batches cannot be honoured; equal to it on a COMPLETED
    trial leaves nothing to train."""
    if newest > batches:
        raise DetTasksError(
            f"experiment {short}: searcher.max_length.batches={batches} is below the "
            f"{newest} batches its trial already trained (its newest checkpoint); give "
            f"{newest} or more"
        )
    if state == COMPLETED and newest == batches:
        raise NothingToContinue(
            f"experiment {short} is COMPLETED at batch {batches}, its searcher.max_length: "
            f"nothing more to train; give a larger one (searcher.max_length.batches=N, "
            f"N > {batches}; det: --config searcher.max_length.batches=N)"
        )


def _refuse_search(short: str, config: dict[str, Any], trials: int, state: str) -> None:
    """Determined continues with a changed config only single-searcher experiments; here
    continue takes only those (a multi-trial search that stopped short is activated)."""
    searcher = config.get("searcher") if isinstance(config.get("searcher"), dict) else {}
    name = str((searcher or {}).get("name") or ("single" if trials <= 1 else "?"))
    if name == "single" and trials <= 1:
        return
    instead = (
        f"continue it where it stopped with `det experiment activate {short}` "
        "(python -m flows.experiment CONFIG --activate KEY without servers)"
        if state in (ORPHANED, PAUSED)
        else "to train one of its trials further, create a single-trial experiment with its "
        "hyperparameters (searcher.name: single), or create the search again"
    )
    raise DetTasksError(
        f"experiment {short} is a {name} search ({trials} trials): continue takes only a "
        f"single-trial experiment (searcher.name: single), as Determined's does; {instead}"
    )


def apply_continuation(client: Any, plan: Continuation, raw_config: dict[str, Any]) -> None:
    """Put the experiment back as Determined's master does before it activates it: parent
    and trial PAUSED (MLflow KILLED), the trial no longer finished in the searcher's state,
    the error of its last run cleared and the active config (``raw_config``) recorded."""
    runs = [plan.parent_run_id] + ([plan.trial_run_id] if plan.trial_run_id else [])
    for run_id in runs:
        client.set_tag(run_id, STATE_TAG, PAUSED)
        retry_mlflow(lambda rid=run_id: client.set_terminated(rid, status="KILLED"))
        with contextlib.suppress(Exception):  # absent: nothing to clear
            client.delete_tag(run_id, ERROR_TAG)
    parent = client.get_run(plan.parent_run_id)
    state = load_searcher_state(parent.data.tags)
    if state is not None:  # single: its one trial trains again, from its checkpoint
        state["results"] = {}
        state["invalid"] = []
        save_searcher_state(client, plan.parent_run_id, state)
    config = json.dumps(raw_config, default=str)
    tags = large_tag(CONFIG_TAG, config, "shorten the config (its largest values)")
    for name, value in tags.items():
        client.set_tag(plan.parent_run_id, name, value)


def continue_in_store(
    experiment_name: str, experiment_key: str, raw_config: dict[str, Any], cfg: ExperimentConfig
) -> str:
    """``python -m flows.experiment CONFIG --continue KEY``: plan and apply the continuation
    in the MLflow store this process records to (MLFLOW_TRACKING_URI, else the embedded
    mode's in the det_tasks home), before anything starts; returns the line to print."""
    uri = recording_store("--continue", experiment_key)
    client = client_for(uri)
    with store_errors("--continue", experiment_key, uri):
        plan = plan_continuation(client, experiment_key, cfg)
    if plan.experiment_name != experiment_name:
        raise DetTasksError(
            f"--continue {experiment_key}: that experiment run is in MLflow experiment "
            f"{plan.experiment_name!r}, not {experiment_name!r} (this config's name): continue "
            "it with the config it ran with"
        )
    apply_continuation(client, plan, raw_config)
    return plan.summary()
