"""Issue 30: an embedded experiment with more trials than a worker builds before it is
recycled hung (a worker restarted itself under a step pinned to it, which Dask then left in
``no-worker`` for good). Workers are now recycled by the flow between steps, and a step
pinned to a worker that is gone is resubmitted unpinned; these tests run the no-server
mode (``python -m flows.experiment``) and check the trials' numbers against known answers:
each XOR trial computed in this process for the same hparams and seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import FLOW_MODEL, PLATFORM_PREFIXES, env_without_platform

REPO = Path(__file__).resolve().parents[2]
RECYCLING = FLOW_MODEL / "recycling.yaml"  # random search, 10 trials of 2 batches, 2 at a time
METRIC = "validation/validation_loss"


def _run_embedded(
    home: Path, overrides: list[str], timeout_s: float = 240, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The experiment with no servers configured, in a fresh DET_TASKS_HOME/PREFECT_HOME;
    the process and its summary (empty when it failed). A hang (what this guards against)
    fails the test with the flow's log, and nothing it started outlives it."""
    args = [sys.executable, "-m", "flows.experiment", str(RECYCLING), *overrides]
    child_env = env_without_platform(
        DET_TASKS_HOME=str(home / "det"),
        PREFECT_HOME=str(home / "prefect"),
        PYTHONPATH=str(REPO),
        **env,
    )
    with subprocess.Popen(
        args,
        cwd=home,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: workers and Prefect server too
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            pytest.fail(f"the experiment hung (> {timeout_s:.0f} s):\n{err[-4000:]}")
        finally:
            _kill_group(child.pid)
    proc = subprocess.CompletedProcess(args, child.returncode, out, err)
    summary = json.loads(out) if child.returncode == 0 else {}
    return proc, summary


def _kill_group(pgid: int) -> None:
    """Whatever the experiment left in its process group (nothing, when it exits well)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _trial_runs(home: Path) -> tuple[list[Any], dict[int, Any]]:
    """All MLflow runs of the experiment, and its trials' runs by trial id."""
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-recycling")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    trials = {
        int(r.data.tags["det.trial_id"]): r for r in runs if "mlflow.parentRunId" in r.data.tags
    }
    return runs, trials


def _hparams(run: Any) -> dict[str, Any]:
    """A trial's hparams from its MLflow params (``hp.NAME``, logged as text)."""
    params = run.data.params
    return {
        "global_batch_size": int(params["hp.global_batch_size"]),
        "learning_rate": float(params["hp.learning_rate"]),
        "hidden": int(params["hp.hidden"]),
    }


def _known_loss(trial_id: int, hparams: dict[str, Any], batches: int = 2) -> float:
    """The trial's validation loss after ``batches``, trained in this process (no MLflow,
    no worker, never recycled): what the experiment must report for it."""
    from det_tasks.runner.held import HeldTrial, TrialSpec

    spec = TrialSpec(str(RECYCLING), str(FLOW_MODEL), (), trial_id, hparams)
    trial = HeldTrial(spec)
    try:
        trial.train_to(batches)
        metrics = trial.validate()
    finally:
        trial.close()
    assert metrics is not None
    return float(metrics["validation_loss"])


@pytest.fixture
def local_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Known answers are computed here with no platform service (a stack fixture earlier
    in the session may have set them in this process)."""
    for name in list(os.environ):
        if name.startswith(PLATFORM_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "known"))


def _assert_known_answers(trials: dict[int, Any], summary: dict[str, Any]) -> None:
    known = {tid: _known_loss(tid, _hparams(run)) for tid, run in trials.items()}
    for tid, run in trials.items():
        assert run.data.metrics[METRIC] == pytest.approx(known[tid], abs=1e-6), tid
    best = min(known, key=known.__getitem__)
    assert summary["best"]["trial_id"] == best
    assert summary["best"]["metric"] == pytest.approx(known[best], abs=1e-6)


def test_recycled_workers_finish_every_trial_with_its_known_answer(
    tmp_path: Path, local_only: None
) -> None:
    pytest.importorskip("mlflow")
    pids = tmp_path / "pids"
    proc, summary = _run_embedded(
        tmp_path, [f"data.pid_file={pids}"], DET_TASKS_WORKER_MAX_TRIALS="2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    runs, trials = _trial_runs(tmp_path)
    assert sorted(trials) == list(range(1, 11))
    assert len(runs) == 11 and all(r.info.status == "FINISHED" for r in runs)
    # Each trial builds in a worker process and writes its pid; 2 workers that build at most
    # 2 trials per process need at least 5 processes for 10 trials (without recycling: 2).
    assert len(set(pids.read_text().split())) >= 5
    _assert_known_answers(trials, summary)


def test_worker_killed_in_a_step_the_trial_still_finishes(tmp_path: Path, local_only: None) -> None:
    """The first validation SIGKILLs its own worker: the step fails (KilledWorker), its
    retry is pinned to the dead worker's address, and must be resubmitted unpinned."""
    pytest.importorskip("mlflow")
    killed = tmp_path / "killed"
    proc, summary = _run_embedded(
        tmp_path, ["searcher.max_trials=2", f"data.kill_once_file={killed}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed.exists(), "no worker was killed: the test tested nothing"

    runs, trials = _trial_runs(tmp_path)
    assert sorted(trials) == [1, 2]
    assert all(r.info.status == "FINISHED" for r in runs)
    _assert_known_answers(trials, summary)
