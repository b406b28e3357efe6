"""Fault matrix (``make test-slow``): SIGKILL of a trial's process, of one distributed rank,
of the MLflow server, of the S3 server and of the Prefect server, each at random points
of an experiment (``python -m flows.experiment`` against the test stack). A killed service
is restarted a moment later. Each run must finish with the undisturbed run's final metric
and weights, and every training point stored exactly once. Prints survived/total per fault
and the seeds of the random points.

Issue 7 asks for each fault at 5 random points. The repeats are not there for flakiness:
each one kills at another moment (before, between or after the checkpoints at batches 30,
60 and 90; while a trial or a service is starting), and a rare failure shows up in one
repeat of five (a distributed rank once survived 4/5). All 25 take about 16 min on CI's
2-core VM, over a quarter of its budget, so ``make test-slow`` runs each fault at
``CI_REPEATS`` random points, with fresh seeds every run (printed), so CI runs add up to
more points over time. ``DET_TASKS_FAULT_REPEATS=5`` runs the matrix as issue 7 asks
(``DET_TASKS_FAULT_REPEATS=5 make test-slow``, or pytest on this file): run it before a
release and after a change to restarts, checkpoints or the services' clients."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infra.services import Service, start
from infra.stack import StackConfig, mlflow_service, prefect_server_service, seaweed_service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KILLABLE = ROOT / "tests" / "fixtures" / "flow_model" / "killable.yaml"
CI_REPEATS = 2
FULL_REPEATS = 5  # issue 7's matrix
REPEATS_ENV = "DET_TASKS_FAULT_REPEATS"
TRAINING_S = 6.0  # 120 batches x sleep_s 0.05


def _experiment(pid_file: Path, extra: list[str]) -> subprocess.Popen[str]:
    args = [f"name=fault-{uuid.uuid4().hex[:8]}", f"data.pid_file={pid_file}", "max_restarts=4"]
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(KILLABLE), *args, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_pids(pid_file: Path, count: int, proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if pid_file.exists():
            pids = [int(p) for p in pid_file.read_text().split()]
            if len(pids) >= count:
                return pids
        time.sleep(0.05)
    raise AssertionError("the trial never started")


def _finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any] | None, str]:
    out, err = proc.communicate(timeout=900)
    summary = json.loads(out) if proc.returncode == 0 else None
    return proc.returncode, summary, err


def _kill_service(service: Service) -> None:
    pid = int(service.pidfile.read_text().strip())
    os.killpg(pid, signal.SIGKILL)


def _weights(checkpoint: str) -> list[torch.Tensor]:
    from det_tasks.pytorch import load_trial_from_checkpoint_path

    trial = load_trial_from_checkpoint_path(checkpoint)
    return [t.clone() for t in trial.model.state_dict().values()]


def _training_steps(summary: dict[str, Any]) -> list[int]:
    from registry.runs.tracking import client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    run_id = summary["best"]["checkpoint"].split("/")[1]
    return [m.step for m in client.get_metric_history(run_id, "training/loss")]


def _matches(summary: dict[str, Any] | None, reference: dict[str, Any]) -> str | None:
    """None when the run equals the reference; else what differs."""
    if summary is None:
        return "the experiment failed"
    if summary["best"]["metric"] != reference["best"]["metric"]:
        return f"metric {summary['best']['metric']} != {reference['best']['metric']}"
    for a, b in zip(_weights(summary["best"]["checkpoint"]), reference["weights"], strict=True):
        if not torch.equal(a, b):
            return "final weights differ"
    steps = _training_steps(summary)
    if steps != sorted(set(steps)) or steps[-1] != 120:
        return f"training points duplicated or missing: {steps[-5:]}"
    return None


# The undisturbed run of each configuration, run once per session: the trial is seeded, so
# every fault test with the same configuration compares against the same final metric and
# weights (four of the five share one), and the suite starts three experiments fewer.
_REFERENCES: dict[tuple[str, ...], dict[str, Any]] = {}


def _reference(tmp_path: Path, extra: list[str]) -> dict[str, Any]:
    key = tuple(extra)
    if key not in _REFERENCES:
        code, summary, err = _finish(_experiment(tmp_path / "ref-pids", extra))
        assert code == 0 and summary is not None, err[-3000:]
        _REFERENCES[key] = {**summary, "weights": _weights(summary["best"]["checkpoint"])}
    return _REFERENCES[key]


def _repeats() -> int:
    """How many random points each fault is tried at: ``REPEATS_ENV``, else CI_REPEATS."""
    raw = os.environ.get(REPEATS_ENV, str(CI_REPEATS))
    if not raw.isdigit() or int(raw) < 1:
        pytest.fail(
            f"{REPEATS_ENV}={raw!r}: expected a whole number of random points per fault, "
            f"at least 1 ({FULL_REPEATS} for issue 7's full matrix)",
            pytrace=False,
        )
    return int(raw)


def _matrix(
    name: str,
    tmp_path: Path,
    extra: list[str],
    pids_needed: int,
    inject: Callable[[list[int], random.Random], None],
) -> None:
    repeats = _repeats()
    reference = _reference(tmp_path, extra)
    failures = []
    seeds = [random.randrange(2**32) for _ in range(repeats)]
    started = time.monotonic()
    for i, seed in enumerate(seeds):
        rng = random.Random(seed)
        pid_file = tmp_path / f"pids-{i}"
        proc = _experiment(pid_file, extra)
        pids = _wait_for_pids(pid_file, pids_needed, proc)
        time.sleep(rng.uniform(0.0, TRAINING_S))
        inject(pids, rng)
        _, summary, err = _finish(proc)
        problem = _matches(summary, reference)
        if problem is not None:
            failures.append(f"seed {seed}: {problem}\n{err[-1500:]}")
    print(
        f"\nSIGKILL {name}: survived {repeats - len(failures)}/{repeats} (seeds {seeds}; "
        f"{(time.monotonic() - started) / repeats:.1f} s a repeat; "
        f"{REPEATS_ENV}={FULL_REPEATS} for issue 7's full matrix)"
    )
    assert not failures, "\n".join(failures)


def _restart_later(service: Service, rng: random.Random) -> None:
    _kill_service(service)
    time.sleep(rng.uniform(0.5, 3.0))
    start(service)


def test_sigkill_trial_process(stack: StackConfig, tmp_path: Path) -> None:
    def inject(pids: list[int], rng: random.Random) -> None:
        os.kill(pids[-1], signal.SIGKILL)

    _matrix("trial process", tmp_path, [], 1, inject)


def test_sigkill_one_distributed_rank(stack: StackConfig, tmp_path: Path) -> None:
    def inject(pids: list[int], rng: random.Random) -> None:
        os.kill(rng.choice(pids[:2]), signal.SIGKILL)

    extra = ["resources.slots_per_trial=2", "resources.distributed_backend=torch"]
    _matrix("one distributed rank", tmp_path, extra, 2, inject)


@pytest.mark.parametrize(
    "make_service",
    [mlflow_service, seaweed_service, prefect_server_service],
    ids=["mlflow-server", "s3-server", "prefect-server"],
)
def test_sigkill_service_then_restart(
    stack: StackConfig, tmp_path: Path, make_service: Callable[[StackConfig], Service]
) -> None:
    service = make_service(stack)

    def inject(pids: list[int], rng: random.Random) -> None:
        _restart_later(service, rng)  # the experiment keeps running (and retrying) meanwhile

    try:
        _matrix(service.name, tmp_path, [], 1, inject)
    finally:
        start(service)  # leave the stack as it was for the tests after this one
