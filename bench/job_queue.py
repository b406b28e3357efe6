"""The shared cluster's job queue (issue 43), measured as users meet it: every experiment is
created with ``det experiment create`` on a stack of the bench's own (its ports, a temporary
folder, stopped at the end), with the flow tests' XOR trial slowed by a sleep per batch.

1. Fair share on 2 workers: a 6-trial grid (2 at a time, 40 s trials), then a second
   experiment once the grid trains. Printed: when the second's trial started against when
   the first slot freed after the queue knew it (from its ``det experiment create`` on), and
   how many grid trials started in between (first come, first served: every one of the
   grid's).
2. Priority on 2 workers: two priority-42 trials hold both workers past the 30 s minimum;
   an experiment with ``resources.priority: 1`` is created. Printed: seconds from the
   ``det experiment create`` command to its trial's first training batch (target: <= 30 s
   plus one batch), and whether the preempted trial's final weights equal a ``det-tasks
   run`` of the same trial that was never preempted.
3. Weights on 4 workers: experiments of weights 1 and 3 (8 trials each, 4 at a time) queued
   behind a 4-trial blocker; the queue (``det job list``'s source) sampled every 0.5 s.
   Printed: the slots each held while both had trials waiting, and how often that was 1
   and 3.

    python bench/job_queue.py [--port-offset 0]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from det_latency import stack_config, until  # noqa: E402  (a sibling script, not a package)

from infra.stack import down, up  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "flow_model"
POLL_S = 0.25  # how often the bench looks (when an experiment asked the queue is timed)
SLEEP_S = 0.1  # per batch: the trials train slowly and lightly, as long trials would


@contextmanager
def a_stack(tmp: Path, offset: int, workers: int) -> Iterator[dict[str, str]]:
    config = stack_config(tmp / f"stack-{workers}", offset)
    os.environ["DET_TASKS_DASK_WORKERS"] = str(workers)
    try:
        print(f"starting a stack with {workers} workers (about a minute)...", file=sys.stderr)
        yield up(config, register=True)
    finally:
        down(config)


def det(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "det"), *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=MODEL,
    )


def create(env: dict[str, str], config: str, *overrides: str) -> str:
    """``det experiment create``; returns the experiment's short id."""
    flags = [part for o in overrides for part in ("--config", o)]
    done = det(env, "experiment", "create", config, ".", *flags)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    match = re.search(r"Created experiment (\S+)", done.stdout)
    if match is None:
        raise RuntimeError(f"no experiment id in: {done.stdout[-1000:]}")
    return match.group(1)


@functools.lru_cache(maxsize=4)
def mlflow(uri: str) -> Any:
    """One MLflow client per stack for the whole bench (it polls every 0.25 s)."""
    from registry.runs.tracking import client_for

    return client_for(uri)


def trials(env: dict[str, str], name: str) -> list[Any]:
    """The experiment's trial runs (MLflow)."""
    client = mlflow(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id])
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def first_batch_s(env: dict[str, str], run: Any) -> float | None:
    """When the run logged its first training metric (epoch seconds), None before."""
    history = mlflow(env["MLFLOW_TRACKING_URI"]).get_metric_history(
        run.info.run_id, "training/loss"
    )
    first = min((m.timestamp for m in history), default=None)
    return None if first is None else first / 1000


def wait_finished(env: dict[str, str], ident: str, timeout_s: float = 900) -> None:
    done = det(env, "experiment", "wait", ident)
    if done.returncode != 0:
        raise RuntimeError(f"experiment {ident}: {done.stdout[-500:]} {done.stderr[-1500:]}")


def fair_share(env: dict[str, str]) -> None:
    grid = create(
        env, "grid.yaml", "name=bench-q-grid", "hyperparameters.hidden.vals=[4,8,16]",
        f"hyperparameters.sleep_s={SLEEP_S}", "searcher.max_length.batches=400",
    )  # fmt: skip
    until(
        lambda: [t for t in trials(env, "bench-q-grid") if first_batch_s(env, t)],
        300,
        "grid",
        every_s=POLL_S,
    )
    second = create(
        env, "killable.yaml", "name=bench-q-second", f"hyperparameters.sleep_s={SLEEP_S}",
        "searcher.max_length.batches=60",
    )  # fmt: skip
    # From when the queue knew it: since issue 53 its create (before: its flow's first report).
    until(
        lambda: any(j["name"] == "bench-q-second" for j in job_list(env)),
        300,
        "asked",
        every_s=POLL_S,
    )
    asked = time.time()
    wait_finished(env, second)
    wait_finished(env, grid)
    grid_trials = trials(env, "bench-q-grid")
    freed = min(t.info.end_time / 1000 for t in grid_trials if t.info.end_time / 1000 > asked)
    (single,) = trials(env, "bench-q-second")
    began = first_batch_s(env, single)
    overtook = sum(1 for t in grid_trials if asked < first_batch_s(env, t) < began)
    print(
        f"1. second experiment (queued behind a 6-trial grid, 2 at a time): its trial started "
        f"{began - freed:+.1f} s after the first slot freed once it had asked; grid trials "
        f"that started after it asked and before it: {overtook} (first come, first served: "
        f"all of the grid's)"
    )


def priority(env: dict[str, str], tmp: Path) -> None:
    holders = create(
        env, "grid.yaml", "name=bench-q-holders", "hyperparameters.hidden=8",
        f"hyperparameters.sleep_s={SLEEP_S}", "searcher.max_length.batches=1500",
    )  # fmt: skip
    both = until(
        lambda: (
            [t for t in trials(env, "bench-q-holders") if first_batch_s(env, t)][1:]
            and trials(env, "bench-q-holders")
        ),
        300,
        "both holders training",
        every_s=POLL_S,
    )
    latest = max(first_batch_s(env, t) or time.time() for t in both)
    time.sleep(max(0.0, latest + 35 - time.time()))  # both past the 30 s minimum
    created = time.time()
    urgent = create(
        env, "killable.yaml", "name=bench-q-urgent", "resources.priority=1",
        "hyperparameters.sleep_s=0", "searcher.max_length.batches=30",
    )  # fmt: skip
    until(
        lambda: any(j["name"] == "bench-q-urgent" for j in job_list(env)),
        300,
        "asked",
        every_s=POLL_S,
    )
    asked = time.time()
    (trial,) = until(
        lambda: [t for t in trials(env, "bench-q-urgent") if first_batch_s(env, t)],
        300,
        "urgent",
        every_s=POLL_S,
    )
    began = first_batch_s(env, trial)
    wait_finished(env, urgent)
    wait_finished(env, holders)
    print(
        f"2. priority 1 trained {began - created:.1f} s after `det experiment create` "
        f"({began - asked:.1f} s after its flow asked the queue; target <= 30 s plus one "
        f"batch, {SLEEP_S} s), every slot held by priority-42 trials past the 30 s minimum"
    )
    print(f"   preempted trial's final weights vs an uninterrupted run: {bit_equal(env, tmp)}")


def bit_equal(env: dict[str, str], tmp: Path) -> str:
    """Compare the holders' preempted trial with a det-tasks run of it never preempted."""
    import torch

    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records

    client = mlflow(env["MLFLOW_TRACKING_URI"])
    runs = trials(env, "bench-q-holders")
    resumed = [r for r in runs if "det.queue_reason" in r.data.tags]
    if not resumed:
        return "no trial was preempted (a miss)"
    run = resumed[0]
    reference = tmp / "reference"
    subprocess.run(
        [
            sys.executable, "-m", "det_tasks.runner.cli", "run", str(MODEL / "grid.yaml"),
            str(MODEL), "--no-progress", "--checkpoint-dir", str(reference),
            "-p", f"hyperparameters.learning_rate={run.data.params['hp.learning_rate']}",
            "-p", "hyperparameters.hidden=8", "-p", "searcher.max_length.batches=1500",
        ],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )  # fmt: skip
    newest = max(reference.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    os.environ.update(env)
    got = pytorch.load_trial_from_checkpoint_path(
        checkpoint_records(client, run.info.run_id)[-1]["uri"]
    )
    want = pytorch.load_trial_from_checkpoint_path(str(newest.parent), trial_class=type(got))
    same = all(
        torch.equal(a, b)
        for a, b in zip(want.model.state_dict().values(), got.model.state_dict().values())
    )
    return "bit-equal" if same else "DIFFERENT (a miss)"


def weights(env: dict[str, str]) -> None:
    """A blocker holds all 4 workers while both weighted experiments queue, so every slot
    that frees is a decision between the two (a first-come experiment's trials that already
    run are never preempted for a share: that is no decision)."""
    common = [
        "hyperparameters.hidden.vals=[4,8,16,32]", "searcher.max_concurrent_trials=4",
        f"hyperparameters.sleep_s={SLEEP_S}", "searcher.max_length.batches=150",
    ]  # fmt: skip
    blocker = create(
        env, "grid.yaml", "name=bench-q-blocker", "hyperparameters.learning_rate=0.05", *common
    )
    until(
        lambda: any(j["name"] == "bench-q-blocker" and j["held"] == 4 for j in job_list(env)),
        300,
        "blocker",
        every_s=POLL_S,
    )
    light = create(env, "grid.yaml", "name=bench-q-w1", "resources.weight=1", *common)
    heavy = create(env, "grid.yaml", "name=bench-q-w3", "resources.weight=3", *common)
    names = {"bench-q-w1", "bench-q-w3"}
    until(lambda: names <= {j["name"] for j in job_list(env)}, 300, "both queued", every_s=POLL_S)
    samples: Counter[tuple[int, int]] = Counter()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        listing = {j["name"]: j for j in job_list(env)}
        if not names & set(listing):
            break
        a, b = listing.get("bench-q-w1"), listing.get("bench-q-w3")
        if a and b and a["wanted"] > a["held"] and b["wanted"] > b["held"]:
            samples[(a["held"], b["held"])] += 1  # both still wait for slots
        time.sleep(0.5)
    for ident in (blocker, light, heavy):
        wait_finished(env, ident)
    total = sum(samples.values())
    shown = ", ".join(f"{a} and {b}: {n}" for (a, b), n in samples.most_common())
    print(
        f"3. weights 1 and 3 on 4 workers (8 trials each, queued behind a 4-trial blocker): "
        f"slots held while both had trials waiting: {shown} ({samples[(1, 3)]} of {total} "
        f"samples, 0.5 s apart, were 1 and 3)"
    )


def job_list(env: dict[str, str]) -> list[dict[str, Any]]:
    from cluster.job_requests import list_jobs

    return list_jobs(env["DET_TASKS_DASK_SCHEDULER"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port-offset", type=int, default=0)
    parser.add_argument(
        "--only", choices=["fair-share", "priority", "weights"], action="append",
        help="run only these parts (repeatable; default: all)",
    )  # fmt: skip
    args = parser.parse_args()
    parts = set(args.only or ["fair-share", "priority", "weights"])
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-job-queue-") as tmp:
        if parts & {"fair-share", "priority"}:
            with a_stack(Path(tmp), args.port_offset, workers=2) as env:
                if "fair-share" in parts:
                    fair_share(env)
                if "priority" in parts:
                    priority(env, Path(tmp))
        if "weights" in parts:
            with a_stack(Path(tmp), args.port_offset, workers=4) as env:
                weights(env)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
