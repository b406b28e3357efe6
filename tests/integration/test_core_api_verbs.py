"""Issue 52 item 4 on the shared stack: lifecycle verbs reach a Core API script through
``should_preempt()``. ``det experiment pause`` stops it at its own checkpoint and ``det
experiment activate`` continues it exactly; a priority-1 experiment makes a running Core API
trial give way (it checkpoints where it stands and resumes exactly once a slot frees). The
counter's value is closed-form: ``x = batch * increment_by``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for
from tests.integration.helpers import REPO, wait_for
from tests.integration.test_core_api_modes import (
    EXAMPLES,
    create,
    deployed,  # noqa: F401 (the module's fixture)
    det,
    history,
    trial_runs,
)


def _checkpointed(client, name: str) -> int:
    """The newest checkpoint's batch of the experiment's only trial (0: none yet)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return 0
    trials = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]
    records = checkpoint_records(client, trials[0].info.run_id) if trials else []
    return max((r["steps_completed"] for r in records), default=0)


def test_det_pause_reaches_should_preempt_and_activate_continues_exactly(deployed):  # noqa: F811
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    name = "core-api-pause"
    exp_id = create(
        "checkpoints.yaml",
        name,
        "hyperparameters.batches=200",
        "hyperparameters.increment_by=3",
        "hyperparameters.batch_seconds=0.05",
        "checkpoint_storage.save_trial_latest=100",  # keep them all, to check each once
    )
    wait_for(lambda: _checkpointed(client, name), 300, "the trial's first checkpoint")
    paused = det("experiment", "pause", exp_id)
    assert paused.returncode == 0, paused.stderr[-2000:]
    _, (trial,) = trial_runs(client, name)
    run_id = trial.info.run_id
    wait_for(lambda: client.get_run(run_id).info.status == "KILLED", 120, "the run paused")
    assert client.get_run(run_id).data.tags["det.state"] == "PAUSED"
    stopped_at = checkpoint_records(client, run_id)[-1]["steps_completed"]
    assert 10 <= stopped_at < 200 and stopped_at % 10 == 0  # the script's own boundary
    assert history(client, run_id, "training/x")[-1] == (stopped_at, 3.0 * stopped_at)
    from det_cli.ids import experiment_run

    wait_for(lambda: experiment_run(exp_id).state == "PAUSED", 120, "the flow run suspended")

    activated = det("experiment", "activate", exp_id)
    assert activated.returncode == 0, activated.stderr[-2000:]
    waited = det("experiment", "wait", exp_id, "--polling-interval", "1", timeout=600)
    assert waited.returncode == 0, waited.stdout[-2000:] + waited.stderr[-2000:]
    steps = range(10, 201, 10)
    assert history(client, run_id, "training/x") == [(n, 3.0 * n) for n in steps]  # each once
    assert history(client, run_id, "validation/x") == [(200, 600.0)]
    assert [r["steps_completed"] for r in checkpoint_records(client, run_id)] == list(steps)
    finished = client.get_run(run_id)
    assert (finished.info.status, finished.data.tags["det.state"]) == ("FINISHED", "COMPLETED")


def test_det_kill_ends_a_core_api_script_at_once(
    deployed,  # noqa: F811
):
    """Determined kills without asking the script. Before, the script trained on through
    the grace period (about 1,000 more batches here) until its worker was killed."""
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    name = "core-api-kill"
    exp_id = create(
        "checkpoints.yaml",
        name,
        "hyperparameters.batches=4000",
        "hyperparameters.batch_seconds=0.05",
    )
    wait_for(lambda: _checkpointed(client, name), 300, "the trial's first checkpoint")
    assert _script_processes(exp_id), "the script's process is not found while it trains"
    killed = det("experiment", "kill", exp_id)
    assert killed.returncode == 0, killed.stderr[-2000:]
    at_kill = history(client, _trial_id(client, name), "training/x")[-1][0]
    run_id = _trial_id(client, name)
    wait_for(lambda: client.get_run(run_id).info.status == "KILLED", 120, "the run killed")
    reported = history(client, run_id, "training/x")
    # 0.05 s a batch: 400 batches are 20 s of training after the kill, at most.
    assert reported[-1][0] < at_kill + 400, (at_kill, reported[-1])
    assert all(x == float(n) for n, x in reported)  # increment_by 1: x = batch
    time.sleep(5)  # a script still alive would report every 10 batches (0.5 s)
    assert history(client, run_id, "training/x") == reported
    assert not _script_processes(exp_id), "the killed script's process is still running"


def _trial_id(client, name: str) -> str:
    _, (trial,) = trial_runs(client, name)
    return trial.info.run_id


def _script_processes(exp_id: str) -> list[int]:
    """The ``det-tasks run`` processes running the experiment's script (its segment runs
    the script in that process), by the experiment run its command line names."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "det_tasks.runner.cli" in argv and "--experiment-run" in argv:
            key = argv[argv.index("--experiment-run") + 1 :][:1]
            if key and key[0].startswith(exp_id):
                found.append(process.pid)
    return found


def _flow(*args: str) -> subprocess.Popen[str]:
    """``python -m flows.experiment`` against the stack, as a second user types it."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(EXAMPLES / "checkpoints.yaml"), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _queued_job(name: str) -> str | None:
    listing = det("job", "list")
    assert listing.returncode == 0, listing.stderr
    for line in listing.stdout.splitlines():
        cells = line.split()
        if name in cells and "QUEUED" in cells:
            return cells[1]
    return None


@pytest.mark.slow  # the queue's minimum run time (30 s) before a preemption, then the resume
def test_a_priority_1_experiment_preempts_a_core_api_trial_that_resumes_exactly(stack):
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    batches = 600  # 0.1 s a batch: each holder trains ~60 s, past the 30 s minimum
    holders = _flow(
        "name=core-api-holders",
        "searcher.name=grid",
        "hyperparameters.increment_by={type: categorical, vals: [1, 2]}",  # both workers
        f"hyperparameters.batches={batches}",
        "hyperparameters.batch_seconds=0.1",
    )
    wait_for(lambda: _checkpointed_all(client, "core-api-holders"), 300, "both holders training")
    urgent = _flow("name=core-api-urgent", "hyperparameters.batches=20")
    job_id = wait_for(lambda: _queued_job("core-api-urgent"), 240, "core-api-urgent QUEUED")
    assert holders.poll() is None, "the holders ended before the urgent experiment queued"
    raised = det("job", "update", job_id, "--priority", "1")
    assert raised.returncode == 0, raised.stderr

    _, urgent_err = urgent.communicate(timeout=600)
    assert urgent.returncode == 0, urgent_err[-3000:]
    assert holders.poll() is None, "the urgent experiment waited for the holders to end"
    _, holders_err = holders.communicate(timeout=600)
    assert holders.returncode == 0, holders_err[-3000:]
    _, (urgent_trial,) = trial_runs(client, "core-api-urgent")
    assert history(client, urgent_trial.info.run_id, "validation/x") == [(20, 20.0)]

    preempted = re.findall(r"trial (\d+) preempted at batch (\d+), checkpoint (\S+):", holders_err)
    assert len(preempted) == 1, holders_err[-3000:]
    trial_id, at_batch, uri = preempted[0][0], int(preempted[0][1]), preempted[0][2]
    assert 10 <= at_batch < batches and at_batch % 10 == 0  # the script's own boundary
    _, trials = trial_runs(client, "core-api-holders")
    run = next(r for r in trials if r.data.tags["det.trial_id"] == trial_id)
    assert uri.startswith(f"runs:/{run.info.run_id}/checkpoints/")
    for trial in trials:  # both exact at every report, none twice, none missing
        increment_by = int(trial.data.params["hp.increment_by"])
        expected = [(n, float(increment_by * n)) for n in range(10, batches + 1, 10)]
        assert history(client, trial.info.run_id, "training/x") == expected
        assert history(client, trial.info.run_id, "validation/x") == [expected[-1]]
        finished = client.get_run(trial.info.run_id)
        assert (finished.info.status, finished.data.tags["det.state"]) == ("FINISHED", "COMPLETED")


def _checkpointed_all(client, name: str) -> bool:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return False
    trials = [
        r
        for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags
    ]
    return len(trials) == 2 and all(checkpoint_records(client, t.info.run_id) for t in trials)
