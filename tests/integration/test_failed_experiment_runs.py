"""When an experiment fails, every run of it says so: the trial that raised, and the trial
still training beside it, end FAILED with det.state ERROR under the FAILED parent. Before,
the flow released the other trial without a state and its run ended FINISHED COMPLETED
after a few of its 40 batches. Embedded mode (python -m flows.experiment, no servers)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.integration.helpers import FLOW_MODEL, home_env

TWO_TRIALS = {
    "name": "failed-beside",
    "entrypoint": "model_def:XorTrial",
    "hyperparameters": {
        "global_batch_size": 8,
        "learning_rate": 0.1,
        "hidden": 6,
        # Trial 1 reaches the planted failure at batch 20 in about a second; trial 2 needs
        # 20 s to (room for trial 1's worker starting late on a loaded host), so it is
        # still training when the experiment fails.
        "sleep_s": {"type": "categorical", "vals": [0.0, 1.0]},
    },
    "searcher": {
        "name": "grid",
        "metric": "validation_loss",
        "max_length": {"batches": 40},
        "max_concurrent_trials": 2,
    },
    "data": {"fail_at_batch": 20},
    "max_restarts": 0,
}


def test_a_trial_beside_the_failing_one_ends_failed_too(tmp_path: Path) -> None:
    from registry.runs.tracking import client_for

    shutil.copy(FLOW_MODEL / "model_def.py", tmp_path / "model_def.py")
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(TWO_TRIALS), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(config)],
        cwd=tmp_path,
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error: trial 1 failed in train_batch at batch 20" in done.stderr
    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("failed-beside")
    runs = client.search_runs([experiment.experiment_id])
    ended = {
        r.info.run_name: (r.info.status, r.data.tags.get("det.state"), r.info.end_time is not None)
        for r in runs
    }
    parent = next(name for name in ended if not name.startswith("trial-"))
    assert ended == {
        parent: ("FAILED", "ERROR", True),
        "trial-1": ("FAILED", "ERROR", True),
        "trial-2": ("FAILED", "ERROR", True),
    }
