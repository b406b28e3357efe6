"""Orchestration costs of the experiment flow, against a running stack (`make up && make deploy`).

1. Latency of `prefect deployment run experiment/const`: submit -> flow running -> trial
   task running -> trial run created in MLflow (training starts right after).
2. Orchestration overhead per trial segment: the train-segment task's duration minus the
   trial's own time in MLflow (its run's start to end).
3. A grid of short trials with concurrency 2 vs the same trials run back to back by the
   local runner, divided by 2: in one process with no services (the harness alone), and as
   one `det-tasks run` process per trial against the same MLflow + S3 (what a user without
   the flow would run).

    source .stack/env && python bench/flow_latency.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def deployment_latency() -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    from registry.tracking import client_for

    t0 = time.time()
    flow_run = run_deployment(
        "experiment/const",
        timeout=600,
        parameters={"overrides": ["searcher.max_length={batches: 20}"]},
    )
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        )
    task = min(tasks, key=lambda t: t.start_time)
    mlflow = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name("mnist-const")
    trial = mlflow.search_runs(
        [exp.experiment_id],
        filter_string="tags.`det.trial_id` = '1'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )[0]
    return {
        "submit_to_flow_running_s": flow_run.start_time.timestamp() - t0,
        "submit_to_task_running_s": task.start_time.timestamp() - t0,
        "submit_to_training_start_s": trial.info.start_time / 1000 - t0,
        "segment_task_s": (task.end_time - task.start_time).total_seconds(),
        "segment_training_s": (trial.info.end_time - trial.info.start_time) / 1000,
        "segment_overhead_s": (task.end_time - task.start_time).total_seconds()
        - (trial.info.end_time - trial.info.start_time) / 1000,
    }


def grid_speedup(trials: int) -> dict[str, float]:
    from det_tasks.runner import run_trial
    from flows.experiment import experiment

    config = ROOT / "tests/fixtures/flow_model/grid.yaml"
    overrides = [
        f"searcher.max_trials={trials}",
        "hyperparameters.learning_rate.vals=" + json.dumps([0.01 * (i + 1) for i in range(trials)]),
        "hyperparameters.hidden.vals=[4]",
        "searcher.max_length={batches: 200}",
    ]
    t0 = time.perf_counter()
    experiment(str(config), overrides)
    flow_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(trials):
        hparams = {"global_batch_size": 8, "learning_rate": 0.01 * (i + 1), "hidden": 4}
        cmd = [sys.executable, "-m", "det_tasks.runner.cli", "run", str(config), "--no-progress"]
        cmd += ["--hparams", json.dumps(hparams)]
        for item in overrides:
            cmd += ["--param", item]
        subprocess.run(cmd, check=True, capture_output=True)
    cli_serial_s = time.perf_counter() - t0
    saved = os.environ.pop("MLFLOW_TRACKING_URI")
    try:
        t0 = time.perf_counter()
        for i in range(trials):
            with tempfile.TemporaryDirectory() as tmp:
                run_trial(
                    config,
                    overrides=overrides,
                    checkpoint_dir=tmp,
                    progress=False,
                    hparams={"global_batch_size": 8, "learning_rate": 0.01 * (i + 1), "hidden": 4},
                )
        serial_s = time.perf_counter() - t0
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = saved
    return {
        "trials": trials,
        "flow_concurrency_2_s": flow_s,
        "back_to_back_in_process_s": serial_s,
        "flow_over_in_process_half": flow_s / (serial_s / 2),
        "back_to_back_cli_with_mlflow_s": cli_serial_s,
        "flow_over_cli_half": flow_s / (cli_serial_s / 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grid-trials", type=int, default=16)
    args = parser.parse_args()
    # No system-metrics sampler in the trials this script starts: it would time it too.
    os.environ["DET_TASKS_SYSTEM_METRICS_INTERVAL"] = "0"
    runs = [deployment_latency() for _ in range(args.repeats)]
    latency = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]} if runs else {}
    print(json.dumps({"deployment": latency, "grid": grid_speedup(args.grid_trials)}, indent=2))


if __name__ == "__main__":
    main()
