"""Issue 52 item 3: searchers drive Core API trials (``python -m flows.experiment``, the
flow an experiment runs on the stack). The counter's value is closed-form (``x = batches *
increment_by``), so each trial's reports are checked against the searcher's choices:

- Determined 0.38's ASHA (``time_metric: batches`` + ``max_time``, no ``max_length``) over a
  script that never calls ``searcher.operations()``: a trial stopped at a rung is told so by
  ``should_preempt()`` and reports nothing past it; the best is continued to ``max_time``;
- random and Optuna searches;
- a trial that ends early with ``report_early_exit(USER_REQUESTED_STOP)`` and one that just
  returns early: both COMPLETED at the batch they stopped at, as Determined 0.38 ends a
  trial whose process exits 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_core_api import EXAMPLES, _flow

EARLY_SCRIPT = """\
import determined as det

hparams = det.get_cluster_info().trial.hparams
with det.core.init() as core_context:
    x = 0
    for step in range(1, 51):
        x += hparams["increment_by"]
        if step % 10 == 0:
            core_context.train.report_validation_metrics(step, {"x": x})
            with core_context.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "x").write_text(str(x))
        if step == 20:
            if hparams["early_exit"]:
                core_context.train.report_early_exit(
                    det.core.EarlyExitReason.USER_REQUESTED_STOP
                )
            break
"""


def _runs(home: Path, experiment: str) -> list[Any]:
    """The experiment's trial runs (MLflow), with the client to read their histories."""
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, experiment
    runs = client.search_runs([found.experiment_id])
    return [(client, r) for r in runs if "mlflow.parentRunId" in r.data.tags]


def _validations(client: Any, run: Any) -> list[tuple[int, float]]:
    history = client.get_metric_history(run.info.run_id, "validation/x")
    return sorted((m.step, m.value) for m in history)


def _run_flow(home: Path, config: str, *overrides: str) -> None:
    proc = _flow(home, "--config", config, *overrides)
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]


def test_asha_with_time_metric_stops_scripts_at_their_rungs_through_should_preempt(tmp_path):
    """asha.yaml: 4 trials, rungs at 10, 20 and 40 batches; the script reports every 10
    batches and would train to 40 unless stopped."""
    _run_flow(tmp_path, str(EXAMPLES / "asha.yaml"))
    trials = _runs(tmp_path, "core-api-asha")
    assert len(trials) == 4
    ends = []
    for client, run in trials:
        increment_by = int(run.data.params["hp.increment_by"])
        history = _validations(client, run)
        assert history and all(x == increment_by * step for step, x in history), history
        end = history[-1][0]
        assert end in (10, 20, 40)  # stopped at a rung, not at the script's own boundary
        assert [s for s, _ in history] == list(range(10, end + 1, 10))  # nothing past it
        finished = client.get_run(run.info.run_id)
        assert (finished.info.status, finished.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
        ends.append((increment_by, end))
    # Asynchronous promotion (Determined's rule): once all 4 reported rung 1, its top half
    # (2) went on, and more may have, promoted while fewer had reported. The worst trial
    # never ranks in the top half of two or more, so it stops at rung 1.
    assert sum(end > 10 for _, end in ends) >= 2
    worst = min(increment_by for increment_by, _ in ends)
    if [increment_by for increment_by, _ in ends].count(worst) == 1:
        assert dict(ends)[worst] == 10, ends
    best = max(increment_by for increment_by, _ in ends)
    assert max(end for increment_by, end in ends if increment_by == best) == 40


@pytest.mark.parametrize("searcher", ["random", "optuna"])
def test_random_and_optuna_searches_over_core_api_trials(tmp_path, searcher):
    if searcher == "optuna":
        pytest.importorskip("optuna")
    # Optuna (the platform's plug-in, not Determined's) needs a length; its pruner would
    # judge at rungs the script (validating only at its end) does not report at.
    length = ["searcher.max_length.batches=20", "searcher.pruner=none"]
    length = length if searcher == "optuna" else []
    search = [
        *length,
        f"searcher.name={searcher}",
        "searcher.max_trials=3",
        "hyperparameters.increment_by={type: int, minval: 1, maxval: 9}",
        "hyperparameters.batches=20",
        "reproducibility.experiment_seed=7",
    ]
    _run_flow(tmp_path, str(EXAMPLES / "checkpoints.yaml"), *search)
    trials = _runs(tmp_path, "core-api-checkpoints")
    assert len(trials) == 3
    for client, run in trials:
        increment_by = int(run.data.params["hp.increment_by"])
        assert 1 <= increment_by <= 9
        assert _validations(client, run) == [(20, 20.0 * increment_by)]
        assert client.get_run(run.info.run_id).data.tags["det.state"] == "COMPLETED"


def test_an_early_exit_and_a_script_that_stops_reporting_both_complete(tmp_path):
    (tmp_path / "train.py").write_text(EARLY_SCRIPT)
    (tmp_path / "exp.yaml").write_text(
        "name: core-api-early\nentrypoint: python3 train.py\n"
        "hyperparameters: {increment_by: 2, early_exit: {type: categorical, vals: [true, false]}}\n"
        "searcher: {name: grid, metric: x, smaller_is_better: false, max_length: {batches: 50}}\n"
        "max_restarts: 0\n"
    )
    _run_flow(tmp_path, str(tmp_path / "exp.yaml"))
    trials = _runs(tmp_path, "core-api-early")
    assert sorted(run.data.params["hp.early_exit"] for _, run in trials) == ["False", "True"]
    for client, run in trials:
        assert _validations(client, run) == [(10, 20.0), (20, 40.0)]
        finished = client.get_run(run.info.run_id)
        assert (finished.info.status, finished.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
