"""Priority preemption on the stack, from ``det experiment create`` of the urgent experiment
to its first trained batch (issue 53 item 4: under 10 s), one line per phase, medians.

Starts a stack of its own (``--port-offset`` shifts its ports, as in bench/det_latency.py;
its 2 Dask workers are the cluster's 2 slots) and creates the holders: a default-priority
(42) grid of the flow tests' XOR trial, 2 trials that train for as long as the bench needs
(0.2 s a batch), one on each worker. Each repeat waits until both holders train and have
trained for the queue's minimum before it may preempt them (``DET_TASKS_PREEMPT_AFTER_S``,
30 s by default, read by the stack's scheduler), then creates the urgent experiment: the
same trial at ``resources.priority=1``, 5 batches. Phases, in seconds from that create:
the command's return, the urgent flow run Running, the queue's ask to a holder to give its
slot (the holders' flow log), the holder's checkpoint that frees it (the same log), the
urgent flow's first task started, and its first trained batch (the first training
metric's timestamp). The urgent experiment's flow run then ends, the preempted holder
resumes, and the next repeat waits for it. The holders are killed at the end.

    python bench/preempt_latency.py [--repeats 3] [--port-offset N] [-v]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.det_latency import Det, full_id, prefect_get, until, xor_stack  # noqa: E402
from bench.flow_latency import ended_states, prefect_time  # noqa: E402

HOLDERS = ["--config", "hyperparameters.hidden=8", "--config", "hyperparameters.sleep_s=0.2",
           "--config", "searcher.max_length={batches: 100000}"]  # fmt: skip
URGENT = ["--config", "resources.priority=1", "--config", "hyperparameters.sleep_s=0",
          "--config", "searcher.max_length={batches: 5}"]  # fmt: skip
PHASES = (
    "create returned", "urgent flow run Running", "a holder asked to give way",
    "the holder's slot freed", "urgent first task started", "urgent first batch",
)  # fmt: skip
ASKED = "gives its slot to more urgent work"
FREED = "preempted at batch"
MIN_RUNTIME_S = float(os.environ.get("DET_TASKS_PREEMPT_AFTER_S", "30"))
_LOG_LINES: list[str] = []


def _created(det: Det, *argv: str) -> tuple[str, float]:
    """``det experiment create ARGV``: the flow-run id and the command's wall seconds."""
    t0 = time.time()
    out = det.timed("experiment create", "experiment", "create", *argv)
    short = next(line for line in out.splitlines() if line.startswith("Created ")).split()[-1]
    return full_id(det.env, short), time.time() - t0


def _running_trains(env: dict[str, str], run_id: str) -> int:
    """How many of the flow run's train tasks are running now."""
    body = {
        "flow_runs": {"id": {"any_": [run_id]}},
        "task_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
    }
    tasks: Any = prefect_get(env, "/task_runs/filter", body)
    return sum(1 for t in tasks if str(t["name"]).startswith("train "))


def _log_times(env: dict[str, str], run_id: str, since: float) -> list[tuple[float, str]]:
    """The flow run's log lines from ``since`` on: (epoch seconds, message)."""
    body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    logs: Any = prefect_get(env, "/logs/filter", body)
    lines = [(prefect_time(log["timestamp"]), str(log["message"])) for log in logs]
    return [(t, m) for t, m in lines if t >= since]


def _first_batch(env: dict[str, str], name: str) -> float:
    """The epoch seconds of the urgent trial's first training metric."""
    from registry.runs.tracking import client_for

    mlflow = client_for(env["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(name)
    assert experiment is not None, f"no MLflow experiment {name}"
    trial = mlflow.search_runs([experiment.experiment_id], "tags.`det.trial_id` = '1'")[0]
    return min(
        min(p.timestamp for p in mlflow.get_metric_history(trial.info.run_id, key)) / 1000
        for key in trial.data.metrics
        if not key.startswith(("validation", "progress/", "system/"))
    )


def urgent_phases(det: Det, holders: str, name: str) -> dict[str, float]:
    """Once both holders have trained past the queue's minimum: the urgent experiment's
    phases, in seconds from its create. Waits for its flow run to end."""
    env = det.env
    until(lambda: _running_trains(env, holders) == 2, 600, "both holders training", 1.0)
    time.sleep(MIN_RUNTIME_S + 2)
    t0 = time.time()
    run_id, returned = _created(det, "killable.yaml", ".", "--config", f"name={name}", *URGENT)
    until(lambda: ended_states(env, run_id), 300, f"urgent flow run {run_id} ends")
    run: Any = prefect_get(env, f"/flow_runs/{run_id}")
    tasks: Any = prefect_get(env, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    held = _log_times(env, holders, t0)
    asked = next(t for t, m in held if ASKED in m)
    freed = next(t for t, m in held if FREED in m)
    _LOG_LINES.append(f"{name}:")
    _LOG_LINES.extend(f"  {t - t0:6.2f} s holders: {m[:110]}" for t, m in held[:6])
    _LOG_LINES.extend(
        f"  {t - t0:6.2f} s urgent: {m[:110]}" for t, m in _log_times(env, run_id, t0)[:12]
    )
    return {
        "create returned": returned,
        "urgent flow run Running": prefect_time(run["start_time"]) - t0,
        "a holder asked to give way": asked - t0,
        "the holder's slot freed": freed - t0,
        "urgent first task started": min(prefect_time(t["start_time"]) for t in tasks) - t0,
        "urgent first batch": _first_batch(env, name) - t0,
    }


def preemption(repeats: int, port_offset: int, verbose: bool) -> None:
    """The holders, then ``repeats`` urgent experiments one after another; the report."""
    with xor_stack("preempt-latency-", port_offset) as (env, workdir):
        det = Det("this tree", ROOT, env, workdir)
        holders, _ = _created(det, "grid.yaml", ".", "--config", "name=bench-holders",
                              *HOLDERS)  # fmt: skip
        try:
            before = os.getloadavg()[0]
            rows = [
                urgent_phases(det, holders, f"bench-urgent-{os.getpid()}-{i}")
                for i in range(repeats)
            ]
            after = os.getloadavg()[0]
        finally:
            det.run("experiment", "kill", holders)
    print(f"load average (1 min) before {before:.2f}, after {after:.2f}; {platform.node()} "
          f"({os.cpu_count()} CPUs); medians of {repeats}, seconds from the urgent "
          f"experiment's `det experiment create` (holders past the {MIN_RUNTIME_S:.0f} s "
          "minimum)")  # fmt: skip
    for phase in PHASES:
        values = [r[phase] for r in rows]
        print(f"{phase}: {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})")
    if verbose:
        print("\n".join(_LOG_LINES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port-offset", type=int, default=0, help="shift the stack's ports")
    parser.add_argument("-v", "--verbose", action="store_true", help="the flow runs' log lines")
    args = parser.parse_args()
    preemption(args.repeats, args.port_offset, args.verbose)


if __name__ == "__main__":
    main()
