"""The ``experiment`` flow: validate a config, expand its searcher into trials, and run each
trial as a chain of train -> validate -> checkpoint segments (Prefect tasks), at most
``max_concurrent_trials`` at once. ``prefect deployment run experiment/const`` starts it.

Run without a server: ``python -m flows.experiment examples/mnist/const.yaml``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from det_tasks.config import ExperimentConfig
from det_tasks.errors import ConfigError
from det_tasks.runner.local import load_raw_config
from det_tasks.searcher import Searcher, Work, make_searcher
from flows.console import quiet_prefect_shutdown
from flows.embedded import use_embedded_defaults
from flows.tasks import TrialFailed, train_segment
from registry.packages import fetch_package
from registry.s3 import client as s3_client
from registry.services import finish_experiment
from registry.settings import RegistrySettings
from registry.tracking import ExperimentRuns, client_for

__all__ = ["experiment"]

STATE_TAG = "det.searcher_state"


def _searcher_metric(summary: dict[str, Any], config: ExperimentConfig) -> float:
    metrics = summary.get("validation") or {}
    name = config.searcher.metric
    if name not in metrics:
        raise RuntimeError(
            f"searcher.metric {name!r} is not among the validation metrics {sorted(metrics)}"
        )
    return float(metrics[name])


def _restore(searcher: Searcher, runs: ExperimentRuns) -> None:
    tags = runs.client.get_run(runs.parent_run_id).data.tags
    if STATE_TAG in tags:
        searcher.load(json.loads(tags[STATE_TAG]))


def _persist(searcher: Searcher, runs: ExperimentRuns) -> None:
    runs.client.set_tag(runs.parent_run_id, STATE_TAG, json.dumps(searcher.state())[:7900])


@flow(name="experiment", log_prints=True)
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
        return _run_experiment(config_path, model_path, overrides)
    finally:
        shutil.rmtree(model_path.parent, ignore_errors=True)


def _run_experiment(config_path: Path, model_path: Path, overrides: list[str]) -> dict[str, Any]:
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
    todo = [w for w in searcher.start() if w.trial_id not in finished or not _final(w, cfg)]
    segment = train_segment.with_options(retries=cfg.max_restarts)
    limit = max(1, cfg.searcher.max_concurrent_trials or 1)
    running: dict[Future[Any], Work] = {}
    best: dict[str, Any] | None = None
    started = time.monotonic()
    logger.info("experiment %r: %d trial(s) to start, at most %d at a time", name, len(todo), limit)
    while todo or running:
        while todo and len(running) < limit:
            work = todo.pop(0)
            future = segment.submit(
                str(config_path),
                str(model_path),
                overrides,
                work.trial_id,
                work.hparams,
                work.batches,
                run_key,
                runs.parent_run_id,
                runs.experiment_id,
                slots=cfg.resources.slots_per_trial,
            )
            running[_as_future(future)] = work
        done, _ = wait_futures(list(running), return_when=FIRST_COMPLETED)
        for fut in done:
            work = running.pop(fut)
            summary = fut.result()
            metric = _searcher_metric(summary, cfg)
            todo.extend(searcher.report(work.trial_id, summary["batches_trained"], metric))
            _persist(searcher, runs)
            logger.info(
                "trial %d: %s=%.6g after %d batches",
                work.trial_id,
                cfg.searcher.metric,
                metric,
                summary["batches_trained"],
            )
            if best is None or _better(metric, best["metric"], cfg):
                best = {
                    "trial_id": work.trial_id,
                    "metric": metric,
                    "hparams": work.hparams,
                    "checkpoint": summary["checkpoint"],
                    "batches_trained": summary["batches_trained"],
                }
    finish_experiment(runs, s3_client(settings.s3_endpoint))
    result = {
        "experiment": name,
        "searcher_metric": cfg.searcher.metric,
        "best": best,
        "mlflow_experiment": _mlflow_link(
            settings.tracking_uri, f"experiments/{runs.experiment_id}"
        ),
        "mlflow_parent_run": _mlflow_link(
            settings.tracking_uri, f"experiments/{runs.experiment_id}/runs/{runs.parent_run_id}"
        ),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    logger.info("summary: %s", json.dumps(result, default=str))
    return result


def _mlflow_link(tracking_uri: str, page: str) -> str:
    """A page of the MLflow UI; for a local store, the command that serves one."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/{page}"
    return f"#/{page} in `mlflow ui --backend-store-uri {tracking_uri}`"


def _final(work: Work, cfg: ExperimentConfig) -> bool:
    return work.batches is None or work.batches == cfg.max_length.value


def _better(value: float, than: float, cfg: ExperimentConfig) -> bool:
    if math.isnan(than):
        return True
    return value < than if cfg.searcher.smaller_is_better else value > than


def _as_future(prefect_future: Any) -> Future[Any]:
    """A concurrent.futures view of a PrefectFuture, so one wait() covers all trials
    (ThreadPoolTaskRunner futures wrap a concurrent.futures.Future)."""
    wrapped = getattr(prefect_future, "wrapped_future", None)
    if isinstance(wrapped, Future):
        proxy: Future[Any] = Future()

        def _done(f: Future[Any]) -> None:
            try:
                proxy.set_result(prefect_future.result())
            except BaseException as err:  # surfaced by fut.result() in the flow
                proxy.set_exception(err)

        wrapped.add_done_callback(_done)
        return proxy
    proxy = Future()
    try:
        proxy.set_result(prefect_future.result())
    except BaseException as err:
        proxy.set_exception(err)
    return proxy


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.experiment CONFIG [key=value ...]``: one experiment, no servers
    needed (see flows.embedded); prints the summary as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m flows.experiment CONFIG [key=value ...]", file=sys.stderr)
        return 2
    try:  # before a Prefect server starts: a typo costs a second, not ten
        load_raw_config(Path(args[0]).resolve(), args[1:])
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
    with quiet_prefect_shutdown(complete_errors=(TrialFailed, ConfigError)):
        try:
            result = experiment(args[0], args[1:])
        except Exception as err:  # the flow run's log above has the details
            print(f"error: experiment failed: {err}", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
