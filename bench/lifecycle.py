"""How fast an experiment stops (issue 22), measured as a user meets it.

- Ctrl-C: ``python -m flows.experiment`` (no servers) of the flow tests' XOR trial, 0.1 s per
  batch, gets SIGINT on its whole process group (what a terminal sends) a few seconds into
  training; printed: seconds until the command exits, until no process of its group is
  left, and whether the last checkpoint is at the batch it stopped at (it must be).
- The stop poll: what the training loop pays per batch to learn of a stop (one
  ``threading.Event.is_set`` and one attribute read), against the trial's own step.

    python bench/lifecycle.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_latency import ROOT, no_server_env  # a sibling script, not a package

CONFIG = ROOT / "tests" / "fixtures" / "flow_model" / "killable.yaml"  # 120 batches


def _group_alive(pgid: int) -> bool:
    out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()]
    return any(r[0] == str(pgid) and not r[1].startswith("Z") for r in rows)


def ctrl_c_once(home: Path) -> tuple[float, float, int, int]:
    """Seconds to exit and to no process left; the stop batch and the last checkpoint's."""
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    pids = home / "pids"
    env = {**no_server_env(home), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "flows.experiment", str(CONFIG)]
    args += ["hyperparameters.sleep_s=0.1", f"data.pid_file={pids}"]
    proc = subprocess.Popen(
        args,
        cwd=home,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not pids.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(4)  # some batches in
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=300)
    exited = time.monotonic() - signalled
    while _group_alive(proc.pid) and time.monotonic() - signalled < 120:
        time.sleep(0.05)
    gone = time.monotonic() - signalled
    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-killable")
    assert experiment is not None, "the experiment made no MLflow runs"
    runs = client.search_runs([experiment.experiment_id], "tags.`det.trial_id` = '1'")
    stopped = int(runs[0].data.metrics["progress/batches"])
    last = checkpoint_records(client, runs[0].info.run_id)[-1]["steps_completed"]
    return exited, gone, stopped, int(last)


def stop_poll_ns() -> float:
    """Nanoseconds per batch for the loop's stop check (an Event and a flag)."""

    class Context:
        _stop_requested = False

    context, event = Context(), threading.Event()
    n = 1_000_000
    seconds = timeit.timeit(lambda: context._stop_requested or event.is_set(), number=n)
    empty = timeit.timeit(lambda: None, number=n)
    return (seconds - empty) / n * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            exited, gone, stopped, last = ctrl_c_once(Path(tmp))
        rows.append((exited, gone))
        ok = "yes" if stopped == last else f"NO (checkpoint at {last})"
        print(
            f"Ctrl-C #{i + 1}: exit {exited:.1f} s, no process left {gone:.1f} s, "
            f"stopped at batch {stopped}, checkpoint there: {ok}"
        )
    print(
        f"Ctrl-C median: exit {statistics.median(r[0] for r in rows):.1f} s, "
        f"no process left {statistics.median(r[1] for r in rows):.1f} s (target <= 30 s)"
    )
    ns = stop_poll_ns()
    print(
        f"stop poll: {ns:.0f} ns per batch; against a 2.5 ms GPU step (H100, MNIST) that is "
        f"{ns / 2.5e6:.5%}, against this trial's 100 ms step {ns / 1e8:.6%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
