"""MLflow experiments and runs: one experiment per config name, a parent run per experiment
run, a nested child run per trial. Re-entrant: asking again for the same trial (a retry,
a resumed flow) returns the same run instead of a duplicate."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.store.db.db_types import DATABASE_ENGINES
from mlflow.tracking import MlflowClient

from det_tasks.config.hyperparameters import flatten_hparams
from registry.runs.experiment_setup import (  # re-exported: their home until issue 53
    DESCRIPTION_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    ensure_experiment,
    experiment_artifact_location,
    mlflow_link,
    report_link,
)
from registry.runs.large_tags import large_tag, load_large_tag
from registry.runs.trial_states import COMPLETED, QUEUED, Progress, honest_end, run_status
from registry.runs.trials_view import (
    TRIALS_VIEW_TAG,
    searched_hparams,
    trials_view_tag,
)
from registry.servers.database_templates import MLFLOW_TEMPLATE
from registry.servers.shared_database import create_once

__all__ = [
    "CONFIG_TAG",
    "DESCRIPTION_TAG",
    "END_REASON_TAG",
    "ERROR_TAG",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "EXPERIMENT_RUN_TAG",
    "HEARTBEAT_TAG",
    "STATE_TAG",
    "TRIAL_TAG",
    "ExperimentRuns",
    "client_for",
    "ensure_experiment",
    "experiment_artifact_location",
    "experiment_config",
    "experiment_params",
    "flat_params",
    "import_tracking_store",
    "mlflow_link",
    "report_link",
    "retry_mlflow",
]

_logger = logging.getLogger(__name__)

TRIAL_TAG = "det.trial_id"
EXPERIMENT_RUN_TAG = "det.experiment_run"
# Why a run ended or what it is doing, in Determined's words (registry.runs.run_states): MLflow's
# statuses cannot say "paused" (KILLED, det.state PAUSED) or "stopped by the searcher"
# (FINISHED, det.state STOPPED).
STATE_TAG = "det.state"
# Why a run FAILED: the error, and for a trial's step the trial, function and batch.
ERROR_TAG = "det.error"
# Why a trial run ended other than as asked (registry.runs.trial_states.honest_end).
END_REASON_TAG = "det.end_reason"
HEARTBEAT_TAG = "det.heartbeat"
PARENT_TAG = "mlflow.parentRunId"
# The experiment run's config as JSON, whole at any size (registry.runs.large_tags); GC reads
# its checkpoint policy back.
CONFIG_TAG = "det.config"


def client_for(tracking_uri: str) -> MlflowClient:
    # MLflow writes "View run ... at: URL" to stdout when a run ends; our commands print
    # machine-readable JSON there (and the same links in it), so the lines stay out.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not tracking_uri.startswith(("http://", "https://")):
        # MLflow's SQLAlchemy store trips SQLAlchemy 2's deprecation of ``noload`` on every
        # process start: MLflow's business, not the user's.
        warnings.filterwarnings("ignore", message=r".*``noload`` loader strategy")
    if tracking_uri.startswith("sqlite:///"):
        # Several experiments started at once in a fresh home would race to create the
        # schema (one fails); the first creates it, the others wait for it.
        database = Path(tracking_uri.removeprefix("sqlite:///"))
        create_once(database, lambda: _create_schema(tracking_uri), MLFLOW_TEMPLATE)
    return MlflowClient(tracking_uri=tracking_uri)


def import_tracking_store(tracking_uri: str) -> None:
    """Import the module of the store MLflow will open for ``tracking_uri`` without opening
    it, so processes forked after this (the warm workers) do not each import it: the
    SQLAlchemy store and its SQLAlchemy models cost ~0.7 s of a worker's first step."""
    dialect = tracking_uri.partition(":")[0].partition("+")[0]  # postgresql+psycopg2 too
    if dialect in DATABASE_ENGINES:  # the URIs MLflow opens with its SQLAlchemy store
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


def _create_schema(tracking_uri: str) -> None:
    MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)


# Top-level settings that bound or pace an experiment, logged beside searcher.* and
# resources.*, with the config's defaults where the YAML leaves them out.
BUDGET_FIELDS = (
    "records_per_epoch",
    "min_validation_period",
    "min_checkpoint_period",
    "checkpoint_policy",
    "perform_initial_validation",
    "max_restarts",
    "reproducibility",
)


def experiment_params(raw_config: dict[str, Any]) -> dict[str, Any]:
    """The experiment's settings as MLflow params, flattened as trial runs' ``hp.*`` are:
    ``searcher.name``, ``searcher.max_length.batches``, ``resources.slots_per_trial``,
    ``max_restarts``, ``reproducibility.experiment_seed``... Defaults the YAML leaves out
    are filled in, so every run says what it ran with."""
    from pydantic import ValidationError

    from det_tasks.config.experiment import ExperimentConfig, ResourcesConfig, SearcherConfig

    params: dict[str, Any] = {}
    for section, model in (("searcher", SearcherConfig), ("resources", ResourcesConfig)):
        given = raw_config.get(section)
        given = given if isinstance(given, dict) else {}
        try:  # the caller validated the whole config; a partial one is logged as given
            values = model.model_validate(given).model_dump(mode="json", exclude_none=True)
        except ValidationError:
            values = given
        params.update(flatten_hparams(values, f"{section}."))
    fields = ExperimentConfig.model_fields
    for name in BUDGET_FIELDS:
        value = raw_config.get(name)
        if value is None:
            default = fields[name].get_default(call_default_factory=True)
            value = default.model_dump(mode="json") if hasattr(default, "model_dump") else default
        if isinstance(value, dict):
            params.update(flatten_hparams(value, f"{name}."))
        elif value is not None:
            params[name] = value
    return params


def flat_params(hparams: dict[str, Any], raw_config: dict[str, Any]) -> dict[str, str]:
    """A trial run's params: its hyperparameters (``hp.*``) plus the experiment's settings
    (``experiment_params``)."""
    params = {f"hp.{k}": v for k, v in flatten_hparams(hparams).items()}
    params.update(experiment_params(raw_config))
    return _as_text(params)


def _as_text(params: dict[str, Any]) -> dict[str, str]:
    return {
        k: (json.dumps(v) if isinstance(v, dict | list) else str(v))[:6000]
        for k, v in params.items()
    }


def _log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    batch = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(batch), 100):
        retry_mlflow(
            lambda chunk=batch[start : start + 100]: client.log_batch(  # type: ignore[misc]
                run_id, params=chunk
            )
        )


class ExperimentRuns:
    """The MLflow side of one experiment run: its experiment, parent run and trial runs."""

    def __init__(
        self, client: MlflowClient, experiment_name: str, run_key: str, raw_config: dict[str, Any]
    ) -> None:
        self.client = client
        description = raw_config.get("description")
        self.experiment_id = ensure_experiment(
            client, experiment_name, str(description) if description else None
        )
        self.raw_config = raw_config
        self._view_columns: tuple[str, ...] | None = None
        found = self._find({EXPERIMENT_RUN_TAG: run_key})
        if found:
            self.parent_run_id = found
        else:
            self.parent_run_id = self._create(
                run_name=f"{experiment_name}-{run_key[:8]}", tags=self._parent_tags(run_key)
            )
            _log_params(client, self.parent_run_id, _as_text(experiment_params(raw_config)))

    def _parent_tags(self, run_key: str) -> dict[str, str]:
        """Created with the run, in one write: the config is never missing or partial."""
        searcher = self.raw_config.get("searcher") or {}
        config = json.dumps(self.raw_config, default=str)
        return {
            EXPERIMENT_RUN_TAG: run_key,
            "det.searcher.metric": str(searcher.get("metric", "")),
            "det.searcher.smaller_is_better": str(searcher.get("smaller_is_better", True)),
            **large_tag(CONFIG_TAG, config, "shorten the config (its largest values)"),
        }

    def trial_run(self, trial_id: str, hparams: dict[str, Any], tags: dict[str, str]) -> str:
        """The child run of ``trial_id``, created once with its params and tags."""
        run_id = self._find({TRIAL_TAG: trial_id, PARENT_TAG: self.parent_run_id})
        if run_id:
            return run_id
        run_id = self._create(
            run_name=f"trial-{trial_id}",
            tags={TRIAL_TAG: trial_id, PARENT_TAG: self.parent_run_id, **tags},
        )
        _log_params(self.client, run_id, flat_params(hparams, self.raw_config))
        self._show_trials(sorted(f"hp.{k}" for k in flatten_hparams(hparams)))
        return run_id

    def _show_trials(self, hp_columns: list[str]) -> None:
        """The experiment's saved runs view (``mlflow_link`` opens it; the runs page's
        "Views" menu lists it): every trial of the experiment, flat, best first by the
        searcher metric, with its state and one column per hyperparameter, and charts of
        the metric against the searched ones. Written when a trial brings columns this run
        has not shown."""
        searcher = self.raw_config.get("searcher") or {}
        metric = searcher.get("metric")
        columns = (str(metric or ""), *hp_columns)
        if self._view_columns is not None and set(columns) <= set(self._view_columns):
            return
        self._view_columns = tuple(dict.fromkeys((*(self._view_columns or ()), *columns)))
        view = trials_view_tag(
            str(metric) if metric else None,
            bool(searcher.get("smaller_is_better", True)),
            list(self._view_columns[1:]),
            searched_hparams(self.raw_config),
            int(time.time() * 1000),
        )
        with contextlib.suppress(MlflowException):  # the view is a convenience
            self.client.set_experiment_tag(self.experiment_id, TRIALS_VIEW_TAG, view)

    def finish(
        self,
        run_id: str,
        status: str = "FINISHED",
        state: str | None = None,
        progress: Progress | None = None,
    ) -> tuple[str, str | None]:
        """End a run with MLflow ``status`` and ``det.state`` ``state`` (default for a
        FINISHED run: COMPLETED; other statuses keep the state already recorded). A state's
        own status wins, so the two never disagree: a trial released because its
        experiment failed (state ERROR) ends FAILED, not KILLED or FINISHED.

        Every trial run ends here, so here is the rule that no trial is COMPLETED short of
        its length (registry.runs.trial_states.honest_end, on the trial's ``progress``): such an
        ending becomes PAUSED, its reason in ``det.end_reason``. Returns the (status,
        state) written."""
        state = state or (COMPLETED if status == "FINISHED" else None)
        if state is not None and run_id != self.parent_run_id:
            state, reason = honest_end(state, progress)
            if reason is not None:
                _logger.warning("trial run %s: %s", run_id, reason)
                self.client.set_tag(run_id, END_REASON_TAG, reason)
        if state is not None:
            status = run_status(state, status)
            self.client.set_tag(run_id, STATE_TAG, state)
        retry_mlflow(lambda: self.client.set_terminated(run_id, status=status))
        return status, state

    def queued(self, run_id: str) -> None:
        """Mark a trial's run QUEUED: it waits for a slot of the shared cluster (running
        again if it had ended, as an activated experiment's paused trial had)."""
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            retry_mlflow(lambda: self.client.update_run(run_id, status="RUNNING"))
        self.client.set_tag(run_id, STATE_TAG, QUEUED)

    def reopen(self, run_id: str) -> bool:
        """Mark a run that ended (a paused, promoted or activated trial, an activated
        experiment) RUNNING again, as it continues; True if it had ended."""
        run = self.client.get_run(run_id)
        ended = run.info.status != "RUNNING"
        if not ended and run.data.tags.get(STATE_TAG) != QUEUED:
            return False
        if ended:
            retry_mlflow(lambda: self.client.update_run(run_id, status="RUNNING"))
        self.client.set_tag(run_id, STATE_TAG, "ACTIVE")  # a queued trial starts, too
        return ended

    def _find(self, tags: dict[str, str]) -> str | None:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=query, max_results=2)
        return runs[0].info.run_id if runs else None

    def _create(self, run_name: str, tags: dict[str, str]) -> str:
        """A new run (its caller has just searched for it: searching again before creating
        would only cost a call, not close the window between the two)."""
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        return str(run.info.run_id)

    def log_metrics(self, run_id: str, metrics: list[Metric]) -> None:
        self.client.log_batch(run_id, metrics=metrics)

    @staticmethod
    def status_of(client: MlflowClient, run_id: str) -> str:
        return str(RunStatus.to_string(client.get_run(run_id).info.status))  # type: ignore[arg-type]


def experiment_config(tags: dict[str, str]) -> dict[str, Any]:
    """The config an experiment run was created with, from its parent run's ``tags`` ({}
    for a run made before the tag existed)."""
    text = load_large_tag(tags, CONFIG_TAG)
    config = json.loads(text) if text else {}
    return config if isinstance(config, dict) else {}


def retry_mlflow(fn: Any, attempts: int = 5) -> Any:
    """``fn()``, retried with backoff on MlflowException: a busy SQLite store refuses a
    write now and then, and a run's state must still be written."""
    for attempt in range(attempts):
        try:
            return fn()
        except MlflowException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * 2**attempt)
    return None
