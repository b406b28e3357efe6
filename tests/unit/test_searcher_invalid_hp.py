"""Issue 15 item 13: a trial that raises det.InvalidHP is dropped by the searcher, and
random / adaptive_asha propose a replacement (single / grid do not), as Determined does."""

from __future__ import annotations

import random

from det_tasks.config import parse_config
from det_tasks.config.hyperparameters import sample_hparams
from det_tasks.searchers.asha import AshaSearcher, asha_brackets
from det_tasks.searchers.base import MAX_INVALID_FACTOR
from det_tasks.searchers.choose import make_searcher
from det_tasks.searchers.random_search import RandomSearcher


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


def _asha(**searcher):
    return make_searcher(_config("adaptive_asha", mode="aggressive", **searcher))


def test_asha_drops_invalid_trial_from_rungs_and_starts_a_replacement():
    searcher = _asha(max_trials=4, max_rungs=3, divisor=2)
    assert isinstance(searcher, AshaSearcher)
    (bracket,) = searcher.brackets
    # aggressive: one bracket of min(3, log2(64) + 1, log2(4) + 1) = 3 rungs.
    assert bracket.budgets == [16, 32, 64]
    start = searcher.start()
    assert [w.trial_id for w in start] == [1, 2, 3, 4]
    searcher.report(1, 16, 0.9)
    # Trial 2 turns out invalid: dropped, and a 5th trial starts at rung 0 (max_trials
    # counts valid trials only).
    replacement = searcher.report_invalid(2)
    assert [(w.trial_id, w.batches) for w in replacement] == [(5, 16)]
    assert 2 not in bracket.rung_results[0]
    # Two results at rung 0 with divisor 2 promote the better one.
    promoted = searcher.report(3, 16, 0.5)
    assert [(w.trial_id, w.batches) for w in promoted] == [(3, 32)]
    state = searcher.state()
    assert state["invalid"] == [2]
    again = _asha(max_trials=4, max_rungs=3, divisor=2)
    again.load(state)
    assert again.invalid == {2} and again.finished() >= {2}
    assert again.brackets[0].promoted[0] == {3}


def test_asha_stop_once_judges_each_trial_once_when_it_finishes_a_rung():
    searcher = _asha(max_trials=16, max_rungs=3, stop_once=True)
    assert isinstance(searcher, AshaSearcher) and searcher.stop_once
    assert searcher.brackets[0].budgets == [4, 16, 64]
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
    assert searcher.brackets[0].promoted[0] == {1, 3, 5}


def test_asha_brackets_follow_mode_and_bracket_rungs_as_determined():
    # The adaptive example: 200 batches, 16 trials, divisor 4, max_rungs 3, standard mode:
    # brackets of 3 and 2 rungs, trials shared 4**2/3 : 4/2 -> 11 and 4, remainder to the first.
    assert asha_brackets(200, 16, 4.0, 3, "standard") == [(3, 12), (2, 4)]
    assert asha_brackets(200, 16, 4.0, 3, "aggressive") == [(3, 16)]
    # conservative: weights 16/3, 2, 1 -> int(10.2), int(3.8), int(1.9), remainder 2 to the first.
    assert asha_brackets(200, 16, 4.0, 3, "conservative") == [(3, 12), (2, 3), (1, 1)]
    # max_rungs is capped by the trial count: 8 trials at divisor 4 allow 2 rungs.
    assert asha_brackets(200, 8, 4.0, 5, "aggressive") == [(2, 8)]
    assert asha_brackets(64, 8, 2.0, 3, "standard", bracket_rungs=[2, 3]) == [(3, 5), (2, 3)]


def test_asha_trials_are_spread_over_brackets_with_their_own_rungs():
    searcher = make_searcher(_config("adaptive_asha", max_trials=16, max_rungs=3, divisor=4))
    assert isinstance(searcher, AshaSearcher)
    assert [b.budgets for b in searcher.brackets] == [[4, 16, 64], [16, 64]]
    start = searcher.start()
    assert [(w.trial_id, w.batches) for w in start] == [(t, 4) for t in range(1, 13)] + [
        (t, 16) for t in range(13, 17)
    ]
    # Four results in the second bracket's first rung promote its best to 64 batches.
    for trial, loss in ((13, 0.4), (14, 0.3), (15, 0.9)):
        assert searcher.report(trial, 16, loss) == []
    assert [(w.trial_id, w.batches) for w in searcher.report(16, 16, 0.8)] == [(14, 64)]


def test_bracket_rungs_config_is_used():
    searcher = _asha(max_trials=8, max_rungs=3, divisor=2, bracket_rungs=[1, 3])
    assert isinstance(searcher, AshaSearcher)
    assert [b.budgets for b in searcher.brackets] == [[16, 32, 64], [64]]


def test_asha_state_is_small_and_round_trips():
    import json

    searcher = make_searcher(_config("adaptive_asha", max_trials=64, max_rungs=4, divisor=2))
    searcher.start()
    for trial in range(1, 65):
        searcher.report(trial, searcher.brackets[searcher.bracket_of[trial]].budgets[0], 1 / trial)
    searcher.report_invalid(3)
    text = json.dumps(searcher.state())
    assert len(text) < 7900  # it lives in one MLflow tag
    again = make_searcher(_config("adaptive_asha", max_trials=64, max_rungs=4, divisor=2))
    again.load(json.loads(text))
    assert again.created == searcher.created
    assert [b.promoted for b in again.brackets] == [b.promoted for b in searcher.brackets]
    assert again.report_invalid(4) == searcher.report_invalid(4)


def test_asha_resumed_start_gives_each_trials_next_rung():
    searcher = _asha(max_trials=4, max_rungs=3, divisor=2)
    searcher.start()
    searcher.report(1, 16, 0.1)
    assert [w.trial_id for w in searcher.report(2, 16, 0.9)] == [1]  # 1 goes on to 32
    again = _asha(max_trials=4, max_rungs=3, divisor=2)
    again.load(searcher.state())
    # 1: promoted, next rung 32; 2: stopped at 16; 3 and 4: not reported yet.
    assert [(w.trial_id, w.batches) for w in again.start()] == [(1, 32), (3, 16), (4, 16)]
