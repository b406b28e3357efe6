"""Issue 15 item 13 through the real flow (no-server mode: Prefect's ephemeral server, Dask
workers, MLflow on SQLite): trials raising det.InvalidHP are dropped, the random searcher
draws a replacement for each, and the experiment still gets max_trials valid trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_embedded import _run

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model" / "invalid_hp.yaml"


def test_invalid_trials_are_dropped_and_replaced(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from registry.runs.tracking import client_for

    proc = _run([str(CONFIG)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-invalid-hp")
    runs = client.search_runs([experiment.experiment_id])
    trials = {
        int(r.data.tags["det.trial_id"]): r for r in runs if "mlflow.parentRunId" in r.data.tags
    }
    # Seed 1 draws hidden = 2, 8, 2, 4, 2, 4 in trial order; hidden 2 is rejected, so
    # trials 1, 3 and 5 are dropped and 4 and 6 replace them: 3 valid trials, as max_trials.
    hidden = {t: int(r.data.params["hp.hidden"]) for t, r in trials.items()}
    assert hidden == {1: 2, 2: 8, 3: 2, 4: 4, 5: 2, 6: 4}
    validated = {t for t, r in trials.items() if "validation/validation_loss" in r.data.metrics}
    assert validated == {2, 4, 6}
    assert summary["best"]["trial_id"] in {2, 4, 6}
