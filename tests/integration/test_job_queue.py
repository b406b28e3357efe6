"""The shared cluster's job queue on the stack (cluster.job_queue): an experiment that
finds every slot held waits QUEUED with its reason; raised above the holders with `det job
update`, it preempts one of their trials once that trial has run the default minimum
(30 s); the preempted trial checkpoints, gives its worker up, resumes when a slot frees, and
ends bit-equal to an uninterrupted run of the same trial, with no batch logged twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import FLOW_MODEL, REPO, flow_experiment, wait_for

LOW_BATCHES = 400  # 0.1 s a batch: each holder trains ~40 s, past the 30 s minimum


def _det(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "det"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _queued_job(name: str) -> list[str] | None:
    listing = _det("job", "list")
    assert listing.returncode == 0, listing.stderr
    for line in listing.stdout.splitlines():
        cells = line.split()
        if name in cells and "QUEUED" in cells:
            return cells
    return None


def _trial_runs(name: str) -> list:
    from registry.runs.tracking import client_for

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    return [
        r
        for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]


def test_a_raised_job_preempts_after_the_minimum_and_the_preempted_trial_resumes_bit_equal(
    stack, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    pids = tmp_path / "pids"
    # The holders wait at each batch while this file exists: they hold both slots until the
    # urgent experiment has been seen QUEUED and raised, however long its flow takes to
    # start (at a load of 25 it came after the holders' 400 batches had ended).
    hold = tmp_path / "hold"
    hold.touch()
    holders = flow_experiment(
        "grid.yaml",
        "name=queue-holders",
        "hyperparameters.hidden=8",  # a grid of 2 (learning rates) on the stack's 2 workers
        "hyperparameters.sleep_s=0.1",
        f"searcher.max_length.batches={LOW_BATCHES}",
        f"data.pid_file={pids}",
        f"data.hold_file={hold}",
    )
    urgent = None
    try:
        wait_for(
            lambda: len(pids.read_text().split()) >= 2 if pids.exists() else False,
            300,
            "both holders training",
        )
        urgent = flow_experiment(
            "killable.yaml",
            "name=queue-urgent",
            "hyperparameters.sleep_s=0",
            "searcher.max_length.batches=30",
        )
        # Same priority (42) as the holders: it waits, QUEUED, and says why.
        cells = wait_for(lambda: _queued_job("queue-urgent"), 300, "queue-urgent QUEUED")
        (trial,) = wait_for(
            lambda: [r for r in _trial_runs("queue-urgent") if "det.queue_reason" in r.data.tags],
            60,
            "its trial's run, with its reason",
        )
        assert trial.data.tags["det.state"] == "QUEUED"
        assert trial.data.tags["det.queue_reason"] == (
            "waiting for a slot: 1 experiment(s) ahead at priority 42 or more urgent"
        )
        assert holders.poll() is None
        job_id = cells[1]
        raised = _det("job", "update", job_id, "--priority", "1")
        assert raised.returncode == 0, raised.stderr
        assert "priority=1" in raised.stdout
    finally:
        hold.unlink(missing_ok=True)  # the holders train on (or end with a failed test)
    assert urgent is not None

    _, urgent_err = urgent.communicate(timeout=600)
    assert urgent.returncode == 0, urgent_err[-3000:]
    assert holders.poll() is None, "the urgent experiment waited for the holders to end"
    _, holders_err = holders.communicate(timeout=600)
    assert holders.returncode == 0, holders_err[-3000:]

    preempted = re.findall(r"trial (\d+) preempted at batch (\d+), checkpoint (\S+):", holders_err)
    assert len(preempted) == 1, holders_err[-3000:]
    trial_id, at_batch, uri = preempted[0][0], int(preempted[0][1]), preempted[0][2]
    assert 0 < at_batch < LOW_BATCHES
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    runs = {r.data.tags["det.trial_id"]: r for r in _trial_runs("queue-holders")}
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    assert {r.data.tags["det.state"] for r in runs.values()} == {"COMPLETED"}
    run = runs[trial_id]
    assert uri.startswith(f"runs:/{run.info.run_id}/checkpoints/")  # the preemption checkpoint
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "training/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == LOW_BATCHES  # none twice, none missing
    records = checkpoint_records(client, run.info.run_id)  # save_trial_latest keeps the last
    assert records[-1]["steps_completed"] == LOW_BATCHES

    # The same trial, never preempted, in one process: bit-equal final weights.
    reference_dir = tmp_path / "reference"
    lr = run.data.params["hp.learning_rate"]
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(FLOW_MODEL / "grid.yaml"),
            str(FLOW_MODEL),
            "--no-progress",
            "-p",
            f"hyperparameters.learning_rate={lr}",
            "-p",
            "hyperparameters.hidden=8",
            "-p",
            "hyperparameters.sleep_s=0",
            "-p",
            f"searcher.max_length.batches={LOW_BATCHES}",
            "--checkpoint-dir",
            str(reference_dir),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    newest = max(reference_dir.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
    want = pytorch.load_trial_from_checkpoint_path(str(newest.parent), trial_class=type(got))
    for a, b in zip(want.model.state_dict().values(), got.model.state_dict().values()):
        assert torch.equal(a, b)
    # Both experiments ended: the queue holds nothing.
    listing = _det("job", "list")
    assert "queue-holders" not in listing.stdout and "queue-urgent" not in listing.stdout
