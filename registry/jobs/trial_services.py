"""MLflow + S3 services for one trial run: what ``det-tasks run`` (and the flows) plug into
the harness when MLFLOW_TRACKING_URI is set."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid as uuid_lib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from det_tasks.errors import StepFailed, TrialStopped
from det_tasks.run_services import RunServices
from registry.checkpoints.gc import collect_experiment_garbage, collect_trial_garbage
from registry.checkpoints.models import trial_runs
from registry.checkpoints.store import CHECKPOINT_TAG, S3CheckpointStore
from registry.experiments.code_snapshot import code_version
from registry.experiments.summary import best_trial, log_best_trial
from registry.metrics.plots import log_interactive_plots, log_learning_curves, trial_curves
from registry.metrics.sink import MlflowMetricsSink
from registry.metrics.system_metrics import start_system_metrics
from registry.metrics.tensorboard_upload import upload_tensorboard
from registry.runs.run_lease import RunLease
from registry.runs.run_nodes import record_node
from registry.runs.tracking import (
    DESCRIPTION_TAG,
    ERROR_TAG,
    ExperimentRuns,
    client_for,
    mlflow_link,
    report_link,
)
from registry.runs.trial_states import ERROR, STOPPED, Progress
from registry.servers import s3 as s3_lib
from registry.servers.settings import RegistrySettings

__all__ = [
    "ERROR_TAG",
    "finish_experiment",
    "start_system_metrics",
    "trial_run_tags",
    "trial_services",
]


def trial_run_tags(raw_config: dict[str, Any], model_dir: Path, seed: int) -> dict[str, str]:
    """The tags a trial run is created with (by the trial itself or by the experiment flow,
    which creates it first so its tasks can name it)."""
    return {
        "det.seed": str(seed),
        "det.code_version": code_version(model_dir),
        "det.entrypoint": str(raw_config.get("entrypoint")),
        "det.user": os.environ.get("USER", ""),
    }


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def trial_services(
    raw_config: dict[str, Any],
    hparams: dict[str, Any],
    *,
    model_dir: Path,
    experiment_name: str,
    trial_id: str = "1",
    experiment_run_key: str | None = None,
    seed: int = 0,
) -> Iterator[RunServices]:
    """An MLflow child run (metrics sink) and its S3 checkpoint store, ended on exit.

    Without ``experiment_run_key`` this trial is the whole experiment run and ends it too;
    with one, an orchestrator (the experiment flow) owns the experiment run.
    """
    owns_experiment_run = experiment_run_key is None
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise RuntimeError("trial_services needs MLFLOW_TRACKING_URI")
    client = client_for(settings.tracking_uri)
    runs = ExperimentRuns(
        client, experiment_name, experiment_run_key or uuid_lib.uuid4().hex, raw_config
    )
    run_id = runs.trial_run(trial_id, hparams, trial_run_tags(raw_config, model_dir, seed))
    runs.reopen(run_id)  # a promoted or activated trial continues its own run
    # Built at its first use: a run whose artifacts are local files (no servers) never
    # needs it, and boto3's set-up was 80 ms of each trial's start on a warm worker.
    s3 = s3_lib.LazyClient(settings.s3_endpoint)
    parts = _run_parts(client, s3, run_id, settings)
    link = mlflow_link(settings.tracking_uri, runs.experiment_id, run_id)
    if owns_experiment_run:
        print(f"MLflow run: {link}", file=sys.stderr)
    monitor = start_system_metrics(settings, run_id)
    status, error = "FAILED", None
    state: str | None = ERROR
    try:
        yield RunServices(
            metrics_sink=parts.sink,
            checkpoint_store=parts.store,
            tensorboard_dir=str(parts.tensorboard_dir),
            run_url=link,
        )
        status, state = "FINISHED", None  # COMPLETED
    except TrialStopped as stopped:  # not a failure: the searcher, a pause, cancel or kill
        # The searcher's stop is a normal end (FINISHED); a stop on request is KILLED.
        status = "FINISHED" if stopped.state == STOPPED else "KILLED"
        state = stopped.state
        raise
    except BaseException as err:
        error = err
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        _end_trial(runs, run_id, s3, parts, (status, state, error), owns_experiment_run)


class _RunParts(NamedTuple):
    """What a trial run writes through, all fenced by one lease (registry.runs.run_lease)."""

    lease: RunLease
    sink: MlflowMetricsSink
    store: S3CheckpointStore
    tensorboard_dir: Path


def _run_parts(client: Any, s3: Any, run_id: str, settings: RegistrySettings) -> _RunParts:
    """Claim the run (this process writes it now; earlier ones stop), and open its metrics
    sink, checkpoint store and TensorBoard folder."""
    lease = RunLease(client, run_id)
    lease.take()
    record_node(client, run_id)
    sink = MlflowMetricsSink(
        client, run_id, spill_dir=settings.cache_dir / "spill" / run_id, lease=lease
    )
    store = S3CheckpointStore(
        client,
        s3,
        run_id,
        artifacts_destination=settings.artifacts_destination,
        cache_dir=settings.cache_dir,
        lease=lease,
        metrics=sink,
    )
    return _RunParts(
        lease,
        sink,
        store,
        Path(tempfile.mkdtemp(prefix="tb-", dir=_mkdir(settings.cache_dir / "tb"))),
    )


def _end_trial(
    runs: ExperimentRuns,
    run_id: str,
    s3: Any,
    parts: _RunParts,
    ending: tuple[str, str | None, BaseException | None],
    owns_experiment_run: bool,
) -> None:
    """Send what is left and end the run, unless another process holds it now (its new
    holder ends it)."""
    parts.store.close()
    parts.sink.close()
    if _fenced(parts.lease):
        shutil.rmtree(parts.tensorboard_dir, ignore_errors=True)
        return
    upload_tensorboard(runs.client, run_id, parts.tensorboard_dir)  # never raises
    _end_runs(runs, run_id, s3, ending, owns_experiment_run, parts.sink.position)


def _fenced(lease: RunLease) -> bool:
    """Whether another process holds the run now. Unknown (MLflow unreachable) counts as
    held: ending the run then fails as it did before, and says so."""
    try:
        return not lease.held()
    except Exception:
        return False


def _end_runs(
    runs: ExperimentRuns,
    run_id: str,
    s3: Any,
    ending: tuple[str, str | None, BaseException | None],
    owns_experiment_run: bool,
    progress: Progress | None = None,
) -> None:
    """End the trial run (and the experiment run it owns) with ``ending``'s (MLflow status,
    det.state, error); a run a failure left empty is deleted instead."""
    client = runs.client
    status, state, error = ending
    if error is not None and _left_empty(client, run_id, owns_experiment_run, runs):
        _delete_runs(client, [run_id] + ([runs.parent_run_id] if owns_experiment_run else []))
        return
    if error is not None:
        _tag_error(client, run_id, error)
    status, state = runs.finish(run_id, status, state, progress)
    if owns_experiment_run:  # its one trial's end is the experiment's (a pause included)
        finish_experiment(runs, s3, status, state if status != "FINISHED" else None)
    elif status == "FINISHED":
        parent = client.get_run(runs.parent_run_id)
        collect_trial_garbage(client, s3, parent, run_id)


def _left_empty(client: Any, run_id: str, owns_parent: bool, runs: ExperimentRuns) -> bool:
    """A trial run that failed before it recorded anything of its own (no training metric,
    no checkpoint), in an experiment run it owns: an empty FAILED pair nobody wants."""
    if not owns_parent:
        return False
    run = client.get_run(run_id)
    recorded = [k for k in run.data.metrics if not k.startswith("system/")]
    return not recorded and not any(k.startswith(CHECKPOINT_TAG) for k in run.data.tags)


def _delete_runs(client: Any, run_ids: list[str]) -> None:
    """Ended FAILED, then deleted: a deleted run still RUNNING would never end (the orphan
    sweep and the UI's "show deleted" see it running for good)."""
    for run_id in run_ids:
        with contextlib.suppress(Exception):  # best effort: the error being raised matters
            client.set_terminated(run_id, "FAILED")
        with contextlib.suppress(Exception):
            client.delete_run(run_id)


def _tag_error(client: Any, run_id: str, error: BaseException) -> None:
    described = isinstance(error, StepFailed)  # its text names the trial, function and batch
    text = (str(error) if described else f"{type(error).__name__}: {error}")[:5000]
    with contextlib.suppress(Exception):
        client.set_tag(run_id, ERROR_TAG, text)


def finish_experiment(
    runs: ExperimentRuns, s3: Any, status: str = "FINISHED", state: str | None = None
) -> None:
    """End of an experiment run: GC by policy, the winner on the parent run, the learning
    curves (PNG) and the interactive plots (HTML), the parent's end."""
    client = runs.client
    parent = client.get_run(runs.parent_run_id)
    trials = trial_runs(client, parent)
    if status == "FINISHED":
        collect_experiment_garbage(client, s3, parent, trials)
        searcher = runs.raw_config.get("searcher") or {}
        metric = searcher.get("metric")
        if metric:
            smaller = bool(searcher.get("smaller_is_better", True))
            best = best_trial(client, trials, metric, smaller)
            if best is not None:
                log_best_trial(client, runs.parent_run_id, best)
            curves = trial_curves(client, trials, metric)
            log_learning_curves(client, runs.parent_run_id, curves, metric)
            page = log_interactive_plots(
                client, runs.parent_run_id, curves, metric, smaller, runs.raw_config
            )
            if page is not None:
                _describe_report(runs, page)
    runs.finish(runs.parent_run_id, status, state)


def _describe_report(runs: ExperimentRuns, path: str) -> None:
    """The parent run's description links its interactive page in MLflow's artifact viewer
    (a plain artifact link would download it)."""
    uri = RegistrySettings.from_env().tracking_uri or ""
    link = report_link(uri, runs.experiment_id, runs.parent_run_id, path)
    if uri.startswith(("http://", "https://")):
        text = f"Learning curves and the metric against each hyperparameter: [{path}]({link})"
    else:
        text = f"Learning curves and the metric against each hyperparameter: {link}"
    runs.client.set_tag(runs.parent_run_id, DESCRIPTION_TAG, text)
