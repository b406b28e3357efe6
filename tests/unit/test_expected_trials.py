"""The progress artifact's "N of M trials": M is max_trials for searchers that propose trials
as others finish (their first proposals are fewer), else the trials known at the start."""

from __future__ import annotations

import pytest

from det_tasks.config import parse_config

BASE = {
    "entrypoint": "model_def:Trial",
    "hyperparameters": {
        "global_batch_size": 8,
        "lr": {"type": "double", "minval": 0.1, "maxval": 1},
    },
}


@pytest.mark.parametrize(
    ("searcher", "known", "expected"),
    [
        ({"name": "random", "max_trials": 64}, 2, 64),
        (
            {"name": "adaptive_asha", "max_trials": 16, "max_time": 64, "time_metric": "batches"},
            4,
            16,
        ),
        ({"name": "optuna", "max_trials": 20}, 2, 20),
        ({"name": "grid", "max_trials": 100}, 3, 3),  # the grid's own size is exact
        ({"name": "single"}, 1, 1),
    ],
)
def test_expected_trials(searcher: dict, known: int, expected: int) -> None:
    from flows.experiment import _expected_trials

    raw = {**BASE, "searcher": {"metric": "loss", "max_length": {"batches": 8}, **searcher}}
    assert _expected_trials(parse_config(raw), known) == expected
