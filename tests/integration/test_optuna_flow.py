"""searcher.name: optuna on the real flow, embedded (Prefect's ephemeral server, MLflow on
SQLite, warm Dask workers): every trial the study asks for runs as a task chain, the
pruned ones end at the first rung as PRUNED, and the parent's best is the best trial's; a
SIGKILLed flow, activated, continues the same study."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import env_without_platform

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "fixtures" / "flow_model" / "optuna.yaml"


def test_optuna_search_runs_on_the_flow(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("optuna")
    from det_tasks.config.loader import load_config
    from det_tasks.searchers.choose import make_searcher
    from registry.runs.searcher_state import load_searcher_state
    from registry.runs.tracking import client_for

    env = env_without_platform(
        DET_TASKS_HOME=str(tmp_path / "det"), PREFECT_HOME=str(tmp_path / "prefect")
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(CONFIG)],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)

    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-optuna")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = {
        int(r.data.tags["det.trial_id"]): r for r in runs if "mlflow.parentRunId" in r.data.tags
    }
    assert sorted(trials) == [1, 2, 3, 4, 5]

    # The study the flow saved replays to the same trials, with the same ones pruned.
    searcher = make_searcher(load_config(CONFIG))
    searcher.load(load_searcher_state(parent.data.tags) or {})
    assert searcher.finished() == {1, 2, 3, 4, 5}
    pruned = searcher.pruned()
    assert pruned, "seed 5 prunes at least one of five trials at the first rung"

    last_loss = {}
    for trial_id, run in trials.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["hp.hidden"] == str(searcher.created[trial_id]["hidden"])
        lr = float(run.data.params["hp.learning_rate"])
        assert lr == pytest.approx(searcher.created[trial_id]["learning_rate"])
        assert 10**-2.5 <= lr <= 10**-0.3
        history = client.get_metric_history(run.info.run_id, "validation/validation_loss")
        steps = sorted(m.step for m in history)
        expected = "PRUNED" if trial_id in pruned else "COMPLETED"
        assert run.data.tags["det.state"] == expected, (trial_id, steps)
        assert steps == ([8] if trial_id in pruned else [8, 16])
        last_loss[trial_id] = min(m.value for m in history)

    best = min(last_loss, key=last_loss.__getitem__)
    assert parent.data.tags["det.best.trial_id"] == str(best)
    assert float(parent.data.tags["det.best.validation_loss"]) == pytest.approx(last_loss[best])
    assert summary["best"]["trial_id"] == best


@pytest.mark.slow
def test_the_study_continues_after_the_flow_is_sigkilled(tmp_path: Path) -> None:
    """SIGKILL the whole flow (its workers and Prefect server too) after three reports, then
    --activate it: the trials asked before the kill keep their hyperparameters, the saved
    event log is the start of the final one, and every trial ends FINISHED as the replayed
    study says (PRUNED or COMPLETED), pruned-before-the-kill ones included."""
    pytest.importorskip("mlflow")
    pytest.importorskip("optuna")
    from det_tasks.config.loader import load_config
    from det_tasks.searchers.choose import make_searcher
    from registry.runs.searcher_state import load_searcher_state
    from registry.runs.tracking import EXPERIMENT_RUN_TAG, client_for

    env = env_without_platform(
        DET_TASKS_HOME=str(tmp_path / "det"), PREFECT_HOME=str(tmp_path / "prefect")
    )
    env = {**env, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(CONFIG)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    db = tmp_path / "det" / "mlflow.db"
    saved: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and len(saved.get("optuna_events", [])) < 3:
            time.sleep(0.5)
            with contextlib.suppress(Exception):  # the store may not exist yet
                parent = _runs(client_for(f"sqlite:///{db}"))[0]
                saved = load_searcher_state(parent.data.tags) or {}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(saved.get("optuna_events", [])) >= 3, "the flow never reported three times"
    client = client_for(f"sqlite:///{db}")
    parent, before = _runs(client)
    asked_before = {t: r.data.params.get("hp.learning_rate") for t, r in before.items()}

    key = parent.data.tags[EXPERIMENT_RUN_TAG]
    done = subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), "--activate", key],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parent, trials = _runs(client)
    final = load_searcher_state(parent.data.tags) or {}
    assert final["optuna_events"][: len(saved["optuna_events"])] == saved["optuna_events"]
    assert asked_before == {t: trials[t].data.params.get("hp.learning_rate") for t in asked_before}
    searcher = make_searcher(load_config(CONFIG))
    searcher.load(final)
    assert sorted(trials) == [1, 2, 3, 4, 5] and searcher.finished() == set(trials)
    for trial_id, run in trials.items():
        assert run.info.status == "FINISHED", trial_id
        expected = "PRUNED" if trial_id in searcher.pruned() else "COMPLETED"
        assert run.data.tags["det.state"] == expected, trial_id
        assert float(run.data.params["hp.learning_rate"]) == pytest.approx(
            searcher.created[trial_id]["learning_rate"]
        )


def _runs(client: Any) -> tuple[Any, dict[int, Any]]:
    experiment = client.get_experiment_by_name("flow-optuna")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = {
        int(r.data.tags["det.trial_id"]): r for r in runs if "mlflow.parentRunId" in r.data.tags
    }
    return parent, trials
