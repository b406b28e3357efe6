"""The searcher's state comes back whole from the parent run at any size: a small one is
one readable JSON tag; a 2,000-trial one (about 60 KB of JSON, past MLflow's 8,000-character
tag limit, where it used to be cut into broken JSON) is compressed over numbered tags.
Real MLflow (a local SQLite store)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


def _state(trials: int) -> dict:
    rng = random.Random(0)
    return {
        "results": {str(t): {"2": rng.random(), "8": rng.random()} for t in range(1, trials + 1)},
        "invalid": [3, 7],
    }


@pytest.mark.parametrize("trials", [10, 2000])
def test_the_state_comes_back_whole(tmp_path: Path, trials: int):
    pytest.importorskip("mlflow")
    from registry.runs.searcher_state import STATE_TAG, load_searcher_state, save_searcher_state
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("state", artifact_location=tmp_path.as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    save_searcher_state(client, run_id, _state(trials // 2))  # an earlier, smaller save
    save_searcher_state(client, run_id, _state(trials))
    tags = client.get_run(run_id).data.tags
    assert load_searcher_state(tags) == _state(trials)
    if trials == 10:
        assert json.loads(tags[STATE_TAG]) == _state(10)  # readable as it is in the UI
    else:
        assert len(json.dumps(_state(trials))) > 8000
        assert all(len(v) <= 8000 for v in tags.values())


def test_no_state_is_none():
    from registry.runs.searcher_state import load_searcher_state

    assert load_searcher_state({"other": "x"}) is None
