"""Orchestration costs of the experiment flow on warm Dask workers, measured side by side.

No servers needed (what issue 14 measured, `python -m flows.experiment` with its embedded
Prefect server, MLflow SQLite store and Dask cluster), interleaved repeats, medians:

1. grid ratio: an 8-trial grid of 40-batch MNIST trials at concurrency 2, as
   (flow wall - 1-batch single-trial flow wall) / (the same 8 trials back to back in one
   process / 2). Target <= 1.5. The process trains on every core, each of the grid's 2
   workers on half of them (det_tasks.cpu_threads); so the ratio is also given against the
   same trials back to back on that share, and the issue's ratio a grid with no overhead at
   all would get (the two back-to-back times' quotient).
2. the 1-batch single-trial flow's wall. Target <= 15 s.
3. warm validate + checkpoint: for each segment of an in-process grid flow, the time from the
   end of its train task to the end of its checkpoint task, minus the validate and checkpoint
   work the worker reports (issue 24's target: <= 50 ms). Each grid trial has one segment,
   so its checkpoint step also ends the trial (MLflow run ended, metrics flushed,
   checkpoints collected, memory freed); the worker times that end apart, and the report
   gives the orchestration alone (Prefect task runs, Dask round trips, the flow's loop) too.

With a running stack (`make up && make deploy`, `source .stack/env`) and `--deployment`:

4. `prefect deployment run experiment/const` -> the trial's first batch (its MLflow run's
   start). Target <= 10 s.

With ``--create`` instead (issue 53 item 4), on a stack of its own (``--port-offset`` shifts
its ports; bench/det_latency.py's) that is idle between experiments: ``det experiment create``
of the flow tests' 1-trial XOR experiment (5 batches), one line per phase, medians, each
from the command's start: the command's return, the flow run's creation, the Prefect
worker's pickup (Pending), the flow run Running (its process started), the first task
started (the queue let the trial start), the trial's MLflow run, and its first trained
batch (the first training metric's timestamp). Target: first batch <= 5 s. With
``--baseline-src DIR`` (another checkout) its ``det experiment create`` takes turns with
this tree's on the same stack: one column each. The flow runs are the stack's worker's, so
this checkout's flow code in both columns: Prefect 3.8's process worker resolves the flow
run's code paths itself (prefect/runner/_workspace_starter.py). A PYTHONPATH and
working_dir set on the deployment were tried; both columns' flow phases still showed this
tree's imports, so the columns differ by ``det experiment create`` alone. ``--settle-s S``
pauses before each experiment: the bench waits only for the flow run before to be
Completed, and a quick ``create`` otherwise starts the next flow while the stack still ends
the last trial.

    python bench/flow_latency.py [--repeats 3] [--deployment |
                                  --create [--port-offset N] [--baseline-src DIR]
                                  [--settle-s S] [-v]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from det_tasks.cpu_threads import threads_per_process

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "examples" / "mnist"
GRID = [
    "hyperparameters.learning_rate.count=4",  # x n_filters1 [16, 32] = 8 trials
    "searcher.max_length={batches: 40}",
]
ONE_BATCH = ["searcher.max_length={batches: 1}", "min_validation_period={batches: 1}"]
WORK = re.compile(r"\((?:warm|restored from [^,]+), ([\d.]+) s(?:; trial ended in ([\d.]+) s)?\)")


def no_server_env(home: Path) -> dict[str, str]:
    """No stack settings, and no system-metrics sampler (it would be timed too)."""
    drop = ("MLFLOW_", "AWS_", "PREFECT_", "DET_TASKS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {
        **env,
        "DET_TASKS_HOME": str(home / "det"),
        "PREFECT_HOME": str(home / "prefect"),
        "DET_TASKS_SYSTEM_METRICS_INTERVAL": "0",
    }


def run_in_home(
    home: Path, *module_args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in ``home`` with no servers configured (``no_server_env``),
    this checkout importable, and ``env`` added; output captured."""
    return subprocess.run(
        [sys.executable, "-m", *module_args],
        cwd=home,
        env={**no_server_env(home), "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
    )


def run_flow(config: Path, overrides: list[str]) -> tuple[float, str]:
    """`python -m flows.experiment CONFIG ...` with no servers configured: its wall seconds
    and its stdout (the summary JSON, nothing else); exits with its stderr if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        done = run_in_home(Path(tmp), "flows.experiment", str(config), *overrides)
        wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"the flow failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall, done.stdout


def flow_wall(config: Path, overrides: list[str]) -> float:
    return run_flow(config, overrides)[0]


def in_process_back_to_back(
    config: Path, overrides: list[str], threads: int | None = None
) -> float:
    """The grid's trials trained one after another in one process (the harness alone), on
    ``threads`` CPU threads (None: torch's default, every core)."""
    code = f"""
import random, sys, tempfile, time
sys.path.insert(0, {str(ROOT)!r})
from det_tasks.config import ExperimentConfig
from det_tasks.runner.in_process import load_raw_config, run_trial
from det_tasks.searchers.choose import make_searcher
from pathlib import Path
_, cfg = load_raw_config(Path({str(config)!r}), {overrides!r})
work = make_searcher(cfg).start()
t0 = time.perf_counter()
for w in work:
    with tempfile.TemporaryDirectory() as tmp:
        run_trial({str(config)!r}, overrides={overrides!r}, checkpoint_dir=tmp, progress=False,
                  hparams=w.hparams, max_batches=w.batches)
print(time.perf_counter() - t0)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DET_TASKS_"))}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=MNIST, env=env, check=True, capture_output=True
    )
    return float(out.stdout.decode().split()[-1])


def warm_step_overheads(trials: int = 4) -> list[tuple[float, float]]:
    """Per segment: (checkpoint task end - train task end) - worker-side validate and
    checkpoint seconds, from an in-process grid flow read back through Prefect's API; and
    the same less the trial's end the checkpoint step made (its worker-side seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as TIMEOUT
    from prefect.settings import temporary_settings

    from cluster.startup import background_cluster
    from flows.embedded import use_embedded_defaults
    from flows.experiment import experiment

    use_embedded_defaults()
    with background_cluster(2), temporary_settings({TIMEOUT: 300}):
        state = experiment(
            str(MNIST / "grid.yaml"),
            [f"hyperparameters.learning_rate.count={trials // 2}", *GRID[1:]],
            return_state=True,
        )
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        deadline = time.monotonic() + 30
        while True:  # until every task's line has arrived: they are sent in batches
            logs = client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [flow_run_id]}))
            work: dict[Any, float] = {}
            ended: dict[Any, float] = {}
            for log in logs:
                match = WORK.search(log.message)
                if match and log.task_run_id:
                    work[log.task_run_id] = float(match.group(1))
                    ended[log.task_run_id] = float(match.group(2) or 0.0)
            if {t.id for t in tasks} <= set(work) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    # Names are the step and the trial: "train trial-3 0-50", "validate trial-3 @50".
    named = {t.name: t for t in tasks}
    overheads: list[tuple[float, float]] = []
    for name, task in named.items():
        if not name.startswith("train "):
            continue
        trial, stop = re.match(r"train (trial-\d+) \d+-(\d+)", name).groups()  # type: ignore[union-attr]
        validate, ckpt = named[f"validate {trial} @{stop}"], named[f"checkpoint {trial} @{stop}"]
        span = (ckpt.end_time - task.end_time).total_seconds()
        beyond_work = span - work[validate.id] - work[ckpt.id]
        overheads.append((beyond_work, beyond_work - ended[ckpt.id]))
    return overheads


def deployment_latency() -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    from registry.runs.tracking import client_for

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
        "submit_to_first_task_running_s": task.start_time.timestamp() - t0,
        "submit_to_training_start_s": trial.info.start_time / 1000 - t0,
    }


_LOG_LINES: list[str] = []  # the flow runs' log lines, seconds from their create
CREATE_PHASES = (
    "create returned", "flow run created", "worker pickup (Pending)", "flow run Running",
    "first task started", "trial's MLflow run", "first batch",
)  # fmt: skip


def prefect_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def create_phases(det: Any, env: dict[str, str], name: str) -> dict[str, float]:
    """``det experiment create`` of a 5-batch XOR experiment on an idle stack; seconds from
    the command's start to each of CREATE_PHASES. Waits for the flow run to end."""
    from bench.det_latency import full_id, prefect_get, until
    from registry.runs.tracking import client_for

    t0 = time.time()
    five = "searcher.max_length={batches: 5}"
    out = det.timed("experiment create", "experiment", "create", "killable.yaml", ".",
                    "--config", f"name={name}", "--config", five)  # fmt: skip
    returned = time.time() - t0
    short = next(line for line in out.splitlines() if line.startswith("Created ")).split()[-1]
    run_id = full_id(env, short)
    states = until(lambda: ended_states(env, run_id), 300, f"flow run {short} ends")
    run: Any = prefect_get(env, f"/flow_runs/{run_id}")
    tasks: Any = prefect_get(env, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    mlflow = client_for(env["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(name)
    assert experiment is not None, f"no MLflow experiment {name}"
    trial = mlflow.search_runs([experiment.experiment_id], "tags.`det.trial_id` = '1'")[0]
    first_points = [
        min(p.timestamp for p in mlflow.get_metric_history(trial.info.run_id, key))
        for key in trial.data.metrics
        if not key.startswith(("validation", "progress/", "system/"))
    ]
    logs: Any = prefect_get(
        env,
        "/logs/filter",
        {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 40},
    )
    _LOG_LINES.append(f"{det.name}, {name}:")
    for log in logs:  # where the flow run's own time goes (--create -v)
        _LOG_LINES.append(f"  {prefect_time(log['timestamp']) - t0:6.2f} s {log['message'][:110]}")
    return {
        "create returned": returned,
        "flow run created": prefect_time(run["created"]) - t0,
        "worker pickup (Pending)": states["PENDING"] - t0,
        "flow run Running": prefect_time(run["start_time"]) - t0,
        "first task started": min(prefect_time(t["start_time"]) for t in tasks) - t0,
        "trial's MLflow run": trial.info.start_time / 1000 - t0,
        "first batch": min(first_points) / 1000 - t0,
    }


def ended_states(env: dict[str, str], run_id: str) -> dict[str, float] | None:
    """The flow run's state types with their first timestamps, once it is COMPLETED."""
    from bench.det_latency import prefect_get

    states: Any = prefect_get(env, f"/flow_run_states/?flow_run_id={run_id}")
    seen: dict[str, float] = {}
    for state in sorted(states, key=lambda s: s["timestamp"]):
        seen.setdefault(state["type"], prefect_time(state["timestamp"]))
    if "FAILED" in seen or "CRASHED" in seen:
        raise RuntimeError(f"flow run {run_id} failed: {states[-1]}")
    return seen if "COMPLETED" in seen else None


def create_to_first_batch(
    repeats: int,
    port_offset: int,
    verbose: bool = False,
    baseline: Path | None = None,
    settle_s: float = 0.0,
) -> None:
    """Issue 53 item 4: one line per phase (median, min-max) over ``repeats`` experiments;
    with ``baseline`` (another checkout), its ``det experiment create`` too, interleaved on
    the same stack (whose worker runs this checkout's flow for both). ``settle_s``: a pause
    before each experiment, for the stack to finish ending the one before."""
    from bench.det_latency import Det, xor_stack

    with xor_stack("create-latency-", port_offset) as (env, workdir):
        dets = [Det("this tree", ROOT, env, workdir)]
        if baseline is not None:
            dets.append(Det("baseline", baseline.resolve(), env, workdir))
        rows: dict[str, list[dict[str, float]]] = {det.name: [] for det in dets}
        for det in dets:  # warm-ups, not counted
            create_phases(det, env, f"bench-create-warmup-{det.name[0]}-{os.getpid()}")
        before = os.getloadavg()[0]
        for i in range(repeats):
            for det in dets:
                time.sleep(settle_s)
                name = f"bench-create-{det.name[0]}-{os.getpid()}-{i}"
                rows[det.name].append(create_phases(det, env, name))
    print(f"load average (1 min) before {before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{platform.node()} ({os.cpu_count()} CPUs); medians of {repeats}, seconds from "
          "`det experiment create`")  # fmt: skip
    for phase in CREATE_PHASES:
        cells = []
        for name, runs in rows.items():
            values = [r[phase] for r in runs]
            cells.append(f"{name} {statistics.median(values):.2f} s "
                         f"({min(values):.2f}-{max(values):.2f})")  # fmt: skip
        print(f"{phase}: " + "; ".join(cells))
    if verbose:
        print("\n".join(_LOG_LINES))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deployment", action="store_true", help="also measure item 4")
    parser.add_argument("--create", action="store_true", help="det experiment create's phases")
    parser.add_argument("--port-offset", type=int, default=0, help="--create: shift its ports")
    parser.add_argument("-v", "--verbose", action="store_true", help="--create: the flow logs")
    parser.add_argument("--baseline-src", type=Path, help="--create: another tree beside this")
    parser.add_argument("--settle-s", type=float, default=0.0,
                        help="--create: pause before each experiment (default 0)")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    if args.create:
        create_to_first_batch(
            args.repeats, args.port_offset, args.verbose, args.baseline_src, args.settle_s
        )
        return
    # No system-metrics sampler in the trials this script starts: it would time it too.
    os.environ["DET_TASKS_SYSTEM_METRICS_INTERVAL"] = "0"
    one, grid, serial, serial_1 = [], [], [], []
    share = threads_per_process(2)  # each of the grid's 2 workers
    for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
        one.append(flow_wall(MNIST / "const.yaml", ONE_BATCH))
        grid.append(flow_wall(MNIST / "grid.yaml", GRID))
        serial.append(in_process_back_to_back(MNIST / "grid.yaml", GRID))
        serial_1.append(in_process_back_to_back(MNIST / "grid.yaml", GRID, share))
    one_s, grid_s, serial_s, serial_1_s = (
        statistics.median(x) for x in (one, grid, serial, serial_1)
    )
    overheads = warm_step_overheads()
    report: dict[str, Any] = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), load {os.getloadavg()}",
        "one_batch_flow_s": round(one_s, 2),
        "grid8_flow_s": round(grid_s, 2),
        "grid8_back_to_back_in_process_s": round(serial_s, 2),
        "grid_ratio": round((grid_s - one_s) / (serial_s / 2), 2),
        # The grid's 2 workers get half the cores each (det_tasks.cpu_threads): against the
        # same trials back to back on that share, the ratio orchestration alone would give.
        "grid8_back_to_back_at_the_workers_share_s": round(serial_1_s, 2),
        "grid_ratio_at_the_workers_share": round((grid_s - one_s) / (serial_1_s / 2), 2),
        # What the ratio would be with no overhead at all: the 2 workers train at
        # their share, so the trials take (at the workers' share) / 2, not (every core) / 2.
        "grid_ratio_with_no_overhead": round(serial_1_s / serial_s, 2),
        # Each grid trial's only segment ends the trial: its checkpoint step also ends the
        # trial's MLflow run, flushes its metrics, collects checkpoints and frees memory.
        "warm_validate_checkpoint_overhead_ms_median": round(
            1000 * statistics.median(o[0] for o in overheads), 1
        ),
        "warm_validate_checkpoint_overhead_ms_max": round(1000 * max(o[0] for o in overheads), 1),
        # The same less the trial's end (as for a segment an ASHA promotion continues): the
        # Prefect task runs and Dask round trips alone.
        "orchestration_only_ms_median": round(1000 * statistics.median(o[1] for o in overheads), 1),
        "trial_end_ms_median": round(1000 * statistics.median(o[0] - o[1] for o in overheads), 1),
        "raw": {
            "one": one,
            "grid": grid,
            "serial": serial,
            "serial_at_the_workers_share": serial_1,
            "overheads": overheads,
        },
    }
    if args.deployment:
        runs = [deployment_latency() for _ in range(args.repeats)]
        report["deployment"] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
