"""Issue 15 item 13: a trial that raises det.InvalidHP is dropped by the searcher, and
random / adaptive_asha propose a replacement (single / grid do not), as Determined does."""

from __future__ import annotations

import random

from det_tasks.config import parse_config
from det_tasks.config.hyperparameters import sample_hparams
from det_tasks.searcher import MAX_INVALID_FACTOR, AshaSearcher, RandomSearcher, make_searcher


def _config(name: str, **searcher) -> object:
    return parse_config(
        {
            "entrypoint": "model_def:Trial",
            "hyperparameters": {
                "global_batch_size": 4,
                "lr": {"type": "double", "minval": 0.0, "maxval": 1.0},
                "width": {"type": "categorical", "vals": [1, 2]},
            },
            "searcher": {"name": name, "metric": "loss", "max_length": {"batches": 64}, **searcher},
            "reproducibility": {"experiment_seed": 5},
        }
    )


def test_random_replaces_an_invalid_trial_with_the_next_sample():
    searcher = make_searcher(_config("random", max_trials=3))
    assert isinstance(searcher, RandomSearcher)
    first = searcher.start()
    assert [w.trial_id for w in first] == [1, 2, 3]
    replacement = searcher.report_invalid(2)
    # The replacement is the 4th draw from the seeded space, the one Determined-style
    # sampling would give next; it trains to the full length as trial 4.
    rng = random.Random(5)
    space = _config("random", max_trials=3).hyperparameters  # type: ignore[attr-defined]
    draws = [sample_hparams(space, rng) for _ in range(4)]
    assert [(w.trial_id, w.hparams, w.batches) for w in replacement] == [(4, draws[3], None)]
    assert [w.hparams for w in first] == draws[:3]
    assert searcher.finished() == {2}
    searcher.report(4, 64, 0.5)
    assert searcher.finished() == {2, 4}
    assert 2 not in searcher.results


def test_random_state_round_trips_replacements():
    searcher = make_searcher(_config("random", max_trials=2))
    searcher.start()
    searcher.report_invalid(1)
    resumed = make_searcher(_config("random", max_trials=2))
    resumed.load(searcher.state())
    assert resumed.trials == searcher.trials
    assert resumed.report_invalid(3) == searcher.report_invalid(3)


def test_random_stops_replacing_after_the_budget():
    searcher = make_searcher(_config("random", max_trials=1))
    searcher.start()
    proposed = 0
    trial = 1
    while True:
        work = searcher.report_invalid(trial)
        if not work:
            break
        proposed += 1
        trial = work[0].trial_id
    assert proposed == MAX_INVALID_FACTOR * 1


def test_grid_and_single_drop_without_replacement():
    for name, extra in (("single", {}), ("grid", {})):
        cfg = _config(name, **extra)
        if name == "grid":
            cfg = parse_config(
                {
                    "entrypoint": "model_def:Trial",
                    "hyperparameters": {
                        "global_batch_size": 4,
                        "width": {"type": "categorical", "vals": [1, 2]},
                    },
                    "searcher": {"name": "grid", "metric": "loss", "max_length": {"batches": 8}},
                }
            )
        searcher = make_searcher(cfg)
        searcher.start()
        assert searcher.report_invalid(1) == []
        assert 1 in searcher.finished()


def test_asha_drops_invalid_trial_from_rungs_and_starts_a_replacement():
    searcher = make_searcher(_config("adaptive_asha", max_trials=4, max_rungs=3))
    assert isinstance(searcher, AshaSearcher)
    assert searcher.budgets == [4, 16, 64]
    start = searcher.start()
    assert [w.trial_id for w in start] == [1, 2, 3, 4]
    searcher.report(1, 4, 0.9)
    searcher.report(2, 4, 0.1)
    searcher.report(3, 4, 0.5)
    # Trial 2 (the best so far) turns out invalid at its next segment: dropped from rung 0,
    # and a 5th trial starts at rung 0 (max_trials counts valid trials only).
    replacement = searcher.report_invalid(2)
    assert [(w.trial_id, w.batches) for w in replacement] == [(5, 4)]
    assert 2 not in searcher.rung_results[0]
    # Rung 0 holds 1, 3, 4: with divisor 4, three results promote nobody; the replacement's
    # result makes four, and the single best of them (trial 5) goes on to rung 1.
    assert searcher.report(4, 4, 0.7) == []
    promoted = searcher.report(5, 4, 0.2)
    assert [(w.trial_id, w.batches) for w in promoted] == [(5, 16)]
    state = searcher.state()
    assert state["invalid"] == [2]
    again = make_searcher(_config("adaptive_asha", max_trials=4, max_rungs=3))
    again.load(state)
    assert again.invalid == {2} and again.finished() >= {2}


def test_asha_stop_once_judges_each_trial_once_when_it_finishes_a_rung():
    searcher = make_searcher(_config("adaptive_asha", max_trials=6, max_rungs=3, stop_once=True))
    assert isinstance(searcher, AshaSearcher) and searcher.stop_once
    searcher.start()
    # n results at rung 0 let max(n // 4, 1) continue: the first always goes on...
    assert [(w.trial_id, w.batches) for w in searcher.report(1, 4, 0.5)] == [(1, 16)]
    # ...a worse second (1 better of 2, allowance 1) stops, a better third goes on.
    assert searcher.report(2, 4, 0.9) == []
    assert [w.trial_id for w in searcher.report(3, 4, 0.1)] == [3]
    # At 4 results the allowance is still 1: second-best stops.
    assert searcher.report(4, 4, 0.2) == []
    # A later, even better result promotes nobody retroactively (trial 2 stays stopped).
    assert [w.trial_id for w in searcher.report(5, 4, 0.05)] == [5]
    assert searcher.promoted[0] == {1, 3, 5}
