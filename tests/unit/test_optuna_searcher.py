"""searcher.name: optuna driven through det_tasks' Searcher interface, no flow: known answers
on a one-variable quadratic, pruning at the first rung, resume by replaying the saved
state, hyperparameter mapping and one-line config errors."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest

from det_tasks.config.loader import parse_config
from det_tasks.errors import ConfigError
from det_tasks.searchers.base import Searcher, Work
from det_tasks.searchers.choose import make_searcher

pytest.importorskip("optuna")

OPTIMUM = 3.0
MAX_BATCHES = 64  # max_length; a Work with batches None trains to it


def _config(**searcher: Any) -> dict[str, Any]:
    seed = searcher.pop("seed", 0)
    hparams = searcher.pop(
        "hparams", {"global_batch_size": 1, "x": {"type": "double", "minval": -10, "maxval": 10}}
    )
    return {
        "entrypoint": "model_def:Trial",
        "hyperparameters": hparams,
        "searcher": {
            "name": "optuna",
            "metric": "loss",
            "max_trials": 8,
            "max_length": {"batches": MAX_BATCHES},
            **searcher,
        },
        "reproducibility": {"experiment_seed": seed},
    }


def _searcher(**searcher: Any) -> Searcher:
    return make_searcher(parse_config(_config(**searcher)))


def _loss(work: Work) -> float:
    """The quadratic, a little worse early in training (so rungs see a real curve)."""
    return (work.hparams["x"] - OPTIMUM) ** 2 + 1.0 / (work.batches or MAX_BATCHES)


def _drive(searcher: Searcher, todo: list[Work], reports: int | None = None) -> list[Work]:
    """Report each work's loss in order; returns every Work handed out after the start."""
    handed: list[Work] = []
    done = 0
    while todo and (reports is None or done < reports):
        work = todo.pop(0)
        new = searcher.report(work.trial_id, work.batches or MAX_BATCHES, _loss(work))
        handed += new
        todo += new
        done += 1
    return handed


def test_tpe_first_batch_is_fixed_by_the_seed() -> None:
    first = _searcher(max_concurrent_trials=4, seed=7).start()
    again = _searcher(max_concurrent_trials=4, seed=7).start()
    other = _searcher(max_concurrent_trials=4, seed=8).start()
    assert len(first) == 4 and [w.trial_id for w in first] == [1, 2, 3, 4]
    assert [w.hparams for w in first] == [w.hparams for w in again]
    assert [w.hparams["x"] for w in first] != [w.hparams["x"] for w in other]
    assert all(w.batches == 1 for w in first)  # default pruner asha: first rung 64/4**3


@pytest.mark.parametrize("seed", range(5))
def test_tpe_finds_the_quadratics_minimum(seed: int) -> None:
    """Within 5% of x* = 3 in at most 50 trials (over seeds 0-19 TPE needed 1-49, median
    20; random search needed 1 to over 200, median 35)."""
    searcher = _searcher(pruner="none", max_trials=50, max_concurrent_trials=1, seed=seed)
    todo = searcher.start()
    tried = list(todo)
    tried += _drive(searcher, todo)
    assert len(tried) == 50
    best = min(tried, key=lambda w: abs(w.hparams["x"] - OPTIMUM))
    assert abs(best.hparams["x"] - OPTIMUM) <= 0.05 * OPTIMUM


def test_asha_pruner_stops_a_clearly_worse_trial_at_the_first_rung() -> None:
    searcher = _searcher(max_concurrent_trials=2)  # defaults: asha, divisor 4 -> rungs 1..64
    one, two = searcher.start()
    assert searcher.report(one.trial_id, 1, 0.1) == [Work(1, one.hparams, 4)]  # continues
    new = searcher.report(two.trial_id, 1, 100.0)
    assert [w.trial_id for w in new] == [3] and new[0].batches == 1  # two pruned, 3 asked
    assert searcher.pruned() == {2}
    assert 2 in searcher.finished() and 1 not in searcher.finished()
    # a trial that reaches max_length is told complete, not pruned
    for batches in (4, 16):
        assert searcher.report(1, batches, 0.05)[0].batches == batches * 4
    assert [w.trial_id for w in searcher.report(1, 64, 0.01)] == [4]
    assert searcher.pruned() == {2} and 1 in searcher.finished()


def test_median_and_hyperband_pruners_judge_at_the_same_rungs() -> None:
    for pruner in ("median", "hyperband"):
        searcher = _searcher(pruner=pruner, max_trials=12, max_concurrent_trials=2)
        todo = searcher.start()
        handed = _drive(searcher, todo)
        assert {w.batches for w in handed} <= {1, 4, 16, 64}
        assert len(searcher.finished()) == 12


def test_state_round_trip_continues_the_same_study() -> None:
    """Interrupted after 9 reports, saved (as JSON, like the MLflow tag) and loaded into a
    fresh searcher: it hands out the open trials again, and from there every proposal and
    pruning decision equals those of an uninterrupted run."""
    settings = {"max_trials": 16, "max_concurrent_trials": 3, "seed": 3}
    whole = _searcher(**settings)
    whole_todo = whole.start()
    _drive(whole, whole_todo, reports=9)
    rest_of_whole = _drive(whole, list(whole_todo))

    first = _searcher(**settings)
    todo = first.start()
    _drive(first, todo, reports=9)
    saved = json.loads(json.dumps(first.state()))
    assert len(json.dumps(saved)) < 2000

    resumed = _searcher(**settings)
    resumed.load(saved)
    restarted = resumed.start()
    assert sorted(restarted, key=lambda w: w.trial_id) == sorted(todo, key=lambda w: w.trial_id)
    assert _drive(resumed, restarted) == rest_of_whole
    assert resumed.pruned() == whole.pruned() and resumed.pruned()
    assert resumed.finished() == whole.finished() == set(range(1, 17))


def test_a_state_that_replays_differently_is_refused() -> None:
    first = _searcher(seed=1)
    _drive(first, first.start(), reports=3)
    other_seed = _searcher(seed=2)
    with pytest.raises(ConfigError, match="does not replay to the same trials"):
        other_seed.load(first.state())
    with pytest.raises(ConfigError, match="not an optuna study"):
        other_seed.load({"results": {}, "invalid": []})


def test_invalid_trials_are_replaced_and_nonfinite_metrics_fail() -> None:
    searcher = _searcher(max_trials=2, max_concurrent_trials=1, pruner="none")
    (first,) = searcher.start()
    (second,) = searcher.report_invalid(first.trial_id)
    assert second.trial_id == 2
    assert searcher.report(2, 64, math.nan) != []  # failed, not counted as a result: a third
    assert searcher.finished() == {1, 2} and not searcher.pruned()


def test_hyperparameter_types_map_onto_optuna() -> None:
    hparams = {
        "global_batch_size": 4,
        "n": {"type": "int", "minval": 2, "maxval": 5},
        "opt": {
            "lr": {"type": "log", "minval": -3, "maxval": 2, "base": 2},
            "kind": {"type": "categorical", "vals": ["sgd", "adam"]},
            "betas": {"type": "categorical", "vals": [[0.9, 0.99], [0.8, 0.9]]},
            "momentum": {"type": "double", "minval": 0.5, "maxval": 0.9},
            "fixed": {"type": "const", "val": "keep"},
        },
    }
    searcher = _searcher(hparams=hparams, max_concurrent_trials=8, max_trials=8)
    works = searcher.start()
    for hp in (w.hparams for w in works):
        assert hp["global_batch_size"] == 4 and hp["opt"]["fixed"] == "keep"
        assert isinstance(hp["n"], int) and 2 <= hp["n"] <= 5
        assert 2**-3 <= hp["opt"]["lr"] <= 2**2
        assert hp["opt"]["kind"] in ("sgd", "adam")
        assert hp["opt"]["betas"] in ([0.9, 0.99], [0.8, 0.9])
        assert 0.5 <= hp["opt"]["momentum"] <= 0.9
    assert set(searcher.study.trials[0].params) == {  # type: ignore[attr-defined]
        "n",
        "opt.lr",
        "opt.kind",
        "opt.betas",
        "opt.momentum",
    }


@pytest.mark.parametrize("sampler", ["cmaes", "gp", "random", "qmc"])
def test_every_sampler_proposes_seeded_points_in_range(sampler: str) -> None:
    hparams = {
        "global_batch_size": 1,
        "x": {"type": "double", "minval": -10, "maxval": 10},
        "y": {"type": "int", "minval": 0, "maxval": 9},
    }
    runs = []
    for _ in range(2):
        searcher = _searcher(sampler=sampler, hparams=hparams, max_concurrent_trials=2)
        todo = searcher.start()
        runs.append(list(todo) + _drive(searcher, todo))
    assert runs[0] == runs[1]
    assert all(-10 <= w.hparams["x"] <= 10 and 0 <= w.hparams["y"] <= 9 for w in runs[0])


def _one_line_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        make_searcher(parse_config(raw))
    text = str(err.value)
    assert "\n" not in text
    return text


def test_bad_sampler_and_pruner_names_name_the_field() -> None:
    text = _one_line_error(_config(sampler="tpee"))
    assert "searcher.sampler" in text and "'tpee'" in text and "did you mean 'tpe'" in text
    text = _one_line_error(_config(pruner="sha"))
    assert "searcher.pruner" in text and "'asha'" in text


def test_cmaes_with_a_categorical_hyperparameter_names_both() -> None:
    hparams = {
        "global_batch_size": 1,
        "x": {"type": "double", "minval": 0, "maxval": 1},
        "y": {"type": "double", "minval": 0, "maxval": 1},
        "opt": {"kind": {"type": "categorical", "vals": ["sgd", "adam"]}},
    }
    text = _one_line_error(_config(sampler="cmaes", hparams=hparams))
    assert "searcher.sampler cmaes" in text and "hyperparameters.opt.kind" in text


def test_optuna_fields_belong_to_the_optuna_searcher() -> None:
    raw = _config(sampler="gp")
    raw["searcher"]["name"] = "random"
    assert "searcher.sampler" in _one_line_error(raw)
    assert "searcher.mode" in _one_line_error(_config(mode="aggressive"))
    assert "searcher.divisor" in _one_line_error(_config(divisor=2.5))


def test_missing_optuna_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in an interpreter where optuna is not installed: importing it fails."""
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "det_tasks.searchers.optuna.search", raising=False)
    monkeypatch.delitem(sys.modules, "det_tasks.searchers.optuna.space", raising=False)
    text = _one_line_error(_config())
    assert "searcher.name 'optuna'" in text and "pip install 'det-tasks[optuna]'" in text
