"""The ``experiment`` flow: validate a config, expand its searcher into trials, and run each
trial as a chain of train -> validate -> checkpoint segments (Prefect tasks), at most
``max_concurrent_trials`` at once. ``prefect deployment run experiment/const`` starts it.

Run without a server: ``python -m flows.experiment examples/mnist/const.yaml``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
from prefect.task_runners import ThreadPoolTaskRunner

from det_tasks.errors import ConfigError
from det_tasks.runner.local import load_raw_config
from det_tasks.searcher import Searcher, make_searcher
from flows.chains import STATE_TAG, TrialChains, final_segment
from flows.console import quiet_prefect_shutdown
from flows.embedded import use_embedded_defaults
from flows.engine import (
    SCHEDULER_ENV,
    Placement,
    background_cluster,
    dask_client,
    release_everywhere,
    worker_memory_mb,
)
from flows.trial_table import TrialTable
from flows.workers import TrialFailed
from registry.packages import fetch_package
from registry.s3 import client as s3_client
from registry.services import finish_experiment
from registry.settings import RegistrySettings
from registry.tracking import ExperimentRuns, client_for, mlflow_link

__all__ = ["experiment"]


def _restore(searcher: Searcher, runs: ExperimentRuns) -> None:
    tags = runs.client.get_run(runs.parent_run_id).data.tags
    if STATE_TAG in tags:
        searcher.load(json.loads(tags[STATE_TAG]))


# Threads only wait on Dask futures; enough for every running trial's task.
@flow(name="experiment", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=64))  # type: ignore[arg-type]
def experiment(
    config: str = "examples/mnist/const.yaml",
    overrides: list[str] | None = None,
    model_dir: str | None = None,
    package: str | None = None,
    config_yaml: str | None = None,
) -> dict[str, Any]:
    """Run every trial the config's searcher proposes; returns the best trial's summary.

    ``package`` (an ``s3://.../packages/<sha256>.tar.gz`` from ``det-tasks experiment
    create``) is unpacked into a fresh folder on this worker; the config is ``config_yaml``
    when given (``config`` then only names it), else the file ``config`` inside the package.
    """
    logger = get_run_logger()
    overrides = list(overrides or [])
    if not package:
        config_path = Path(config).resolve()
        model_path = Path(model_dir).resolve() if model_dir else config_path.parent
        return _run_experiment(config_path, model_path, overrides)
    model_path = fetch_package(package)
    logger.info("model package %s unpacked into %s", package, model_path)
    config_path = (model_path / config).resolve()
    if config_yaml is not None:
        config_path = model_path.parent / Path(config).name
        config_path.write_text(config_yaml, encoding="utf-8")
    try:
        if not config_path.is_relative_to(model_path.parent.resolve()):
            raise ConfigError(f"config {config!r} is outside the model package: give a path in it")
        return _run_experiment(config_path, model_path, overrides, package)
    finally:
        shutil.rmtree(model_path.parent, ignore_errors=True)


def _run_experiment(
    config_path: Path, model_path: Path, overrides: list[str], package: str | None = None
) -> dict[str, Any]:
    logger = get_run_logger()
    raw, cfg = load_raw_config(config_path, overrides)  # fails fast, naming the field
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise RuntimeError(
            "MLFLOW_TRACKING_URI is not set on this worker: start the stack (make up) and "
            "source .stack/env, or run without servers: python -m flows.experiment CONFIG"
        )
    name = cfg.name or config_path.stem
    run_key = str(flow_run.get_id() or uuid.uuid4())
    runs = ExperimentRuns(client_for(settings.tracking_uri), name, run_key, raw)
    searcher = make_searcher(cfg)
    _restore(searcher, runs)
    finished = searcher.finished()
    todo = [w for w in searcher.start() if w.trial_id not in finished or not final_segment(w, cfg)]
    limit = max(1, cfg.searcher.max_concurrent_trials or 1)
    table = TrialTable(
        name,
        cfg.searcher.metric,
        cfg.searcher.smaller_is_better,
        lambda run_id: mlflow_link(settings.tracking_uri or "", runs.experiment_id, run_id),
    )
    started = time.monotonic()
    logger.info("experiment %r: %d trial(s) to start, at most %d at a time", name, len(todo), limit)
    logger.info("MLflow: %s", mlflow_link(settings.tracking_uri, runs.experiment_id))
    with dask_client(limit, gpu_slots=cfg.resources.slots_per_trial) as client:
        trials = TrialChains(
            cfg,
            raw,
            runs,
            config_path,
            model_path,
            overrides,
            run_key,
            package,
            table,
            Placement(client),
        )
        best = trials.run(todo, searcher, limit)
        released = release_everywhere(client)
        trials.wait_releases()
    if released:
        logger.info("released %d held trial(s)", released)
    table.publish()
    finish_experiment(runs, s3_client(settings.s3_endpoint))
    result = {
        "experiment": name,
        "searcher_metric": cfg.searcher.metric,
        "best": best,
        "mlflow_experiment": mlflow_link(settings.tracking_uri, runs.experiment_id),
        "mlflow_parent_run": mlflow_link(
            settings.tracking_uri, runs.experiment_id, runs.parent_run_id
        ),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    logger.info("summary: %s", json.dumps(result, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.experiment CONFIG [key=value ...]``: one experiment, no servers
    needed (see flows.embedded); prints the summary as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m flows.experiment CONFIG [key=value ...]", file=sys.stderr)
        return 2
    try:  # before a Prefect server starts: a typo costs a second, not ten
        _, cfg = load_raw_config(Path(args[0]).resolve(), args[1:])
        worker_memory_mb()  # DET_TASKS_WORKER_MEMORY_MB, checked before anything starts
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    chosen = use_embedded_defaults()
    if chosen:
        print(
            f"no MLFLOW_TRACKING_URI: runs go to {chosen['MLFLOW_TRACKING_URI']} "
            f"(browse: mlflow ui --backend-store-uri {chosen['MLFLOW_TRACKING_URI']})",
            file=sys.stderr,
        )
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    workers = max(1, cfg.searcher.max_concurrent_trials or 1)
    with (
        # Without a cluster named, its workers start while Prefect's server does.
        contextlib.nullcontext()
        if os.environ.get(SCHEDULER_ENV)
        else background_cluster(workers, cfg.resources.slots_per_trial),
        quiet_prefect_shutdown(complete_errors=(TrialFailed, ConfigError)),
        # The ephemeral server's default 20 s start-up wait is too short on a busy machine.
        temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 300}),
    ):
        try:
            result = experiment(args[0], args[1:])
        except Exception as err:  # the flow run's log above has the details
            print(f"error: experiment failed: {err}", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
