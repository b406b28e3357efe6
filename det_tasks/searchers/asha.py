"""Determined's ``adaptive_asha`` searcher: brackets of rungs, trials promoted by their
searcher metric (asynchronous successive halving)."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from det_tasks.config.hyperparameters import sample_hparams
from det_tasks.errors import ConfigError
from det_tasks.searchers.base import MAX_INVALID_FACTOR, Searcher, Work

__all__ = ["AshaSearcher", "asha_brackets"]


def asha_brackets(
    max_batches: int,
    max_trials: int,
    divisor: float,
    max_rungs: int,
    mode: str,
    bracket_rungs: list[int] | None = None,
) -> list[tuple[int, int]]:
    """(rungs, max_trials) per bracket, as Determined's adaptive_asha lays them out.

    Without ``bracket_rungs``, max_rungs is capped by what the length and the trial count
    allow (``log_divisor`` of each, plus one), and ``mode`` picks the brackets: aggressive
    one of max_rungs rungs, standard those of (max_rungs-1)//2+1 .. max_rungs rungs,
    conservative 1 .. max_rungs. Brackets with more rungs (more early stopping) come first;
    trials are shared so each bracket gets about the same total budget, the remainder going
    to the first.
    """  # fmt: skip
    if bracket_rungs:
        brackets = list(bracket_rungs)
    else:
        rungs = min(
            max_rungs,
            int(math.log(max(max_batches, 1)) / math.log(divisor)) + 1,
            int(math.log(max(max_trials, 1)) / math.log(divisor)) + 1,
        )
        first = {"aggressive": rungs, "standard": (rungs - 1) // 2 + 1, "conservative": 1}[mode]
        brackets = list(range(first, rungs + 1))
    brackets.sort(reverse=True)
    weights = [divisor ** (r - 1) / r for r in brackets]
    counts = [max(int(w / sum(weights) * max_trials), 1) for w in weights]
    counts[0] += max(max_trials - sum(counts), 0)
    return list(zip(brackets, counts))


@dataclasses.dataclass
class _Bracket:
    """One successive-halving bracket: its rung lengths, trials and per-rung results."""

    budgets: list[int]
    max_trials: int
    trials: set[int] = dataclasses.field(default_factory=set)
    rung_results: list[dict[int, float]] = dataclasses.field(default_factory=list)
    promoted: list[set[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.rung_results = self.rung_results or [{} for _ in self.budgets]
        self.promoted = self.promoted or [set() for _ in self.budgets]


class AshaSearcher(Searcher):
    """Asynchronous successive halving in brackets (Determined's adaptive_asha).

    A bracket of R rungs trains to ``int(max_batches / divisor**(R-1-k))`` at rung k (the
    last rung: max_batches); a trial finishing rung k is promoted when it is in the top
    ``1/divisor`` of its bracket's trials that have finished rung k, possibly later as more
    of them finish; otherwise it stops there. See asha_brackets for the bracket layout.

    ``stop_once`` (Determined's stopping variant): each trial is judged once, when it
    finishes a rung: it goes on if it ranks within the top ``max(n // divisor, 1)`` of the
    n results recorded at that rung so far (itself included), and is never promoted later.
    """

    def __init__(
        self,
        space: dict[str, Any],
        seed: int,
        max_batches: int,
        max_trials: int,
        divisor: float,
        max_rungs: int,
        smaller_is_better: bool,
        stop_once: bool = False,
        mode: str = "aggressive",
        bracket_rungs: list[int] | None = None,
    ) -> None:
        self.stop_once = stop_once
        self.brackets = [
            _Bracket(_rung_lengths(max_batches, rungs, divisor), trials)
            for rungs, trials in asha_brackets(
                max_batches, max_trials, divisor, max_rungs, mode, bracket_rungs
            )
        ]
        self.seed = seed
        self.rng = random.Random(seed)
        self.space = space
        self.max_trials = max_trials
        self.divisor = divisor
        self.smaller = smaller_is_better
        self.created: dict[int, dict[str, Any]] = {}
        self.bracket_of: dict[int, int] = {}
        super().__init__([], max_batches)

    def _new_trial(self, b: int) -> Work | None:
        bracket = self.brackets[b]
        if len(bracket.trials - self.invalid) >= bracket.max_trials:
            return None
        if len(self.invalid) > MAX_INVALID_FACTOR * self.max_trials:
            return None
        trial_id = len(self.created) + 1
        self.created[trial_id] = sample_hparams(self.space, self.rng)
        self.bracket_of[trial_id] = b
        bracket.trials.add(trial_id)
        return Work(trial_id, self.created[trial_id], bracket.budgets[0])

    def start(self) -> list[Work]:
        """The work to do now: after load(), every known trial's next rung (a trial that
        stopped, or finished its last rung, has none); then new trials until each bracket
        has its share."""
        works = [w for w in (self._next_rung(t) for t in sorted(self.created)) if w]
        for b, bracket in enumerate(self.brackets):
            works += [w for w in (self._new_trial(b) for _ in range(bracket.max_trials)) if w]
        return works

    def _next_rung(self, trial_id: int) -> Work | None:
        if trial_id in self.invalid:
            return None
        bracket = self.brackets[self.bracket_of[trial_id]]
        done = self.results.get(trial_id, {})
        for k, budget in enumerate(bracket.budgets):
            if budget not in done:
                return Work(trial_id, self.created[trial_id], budget)
            if trial_id not in bracket.promoted[k]:
                return None
        return None

    def report(self, trial_id: int, batches: int, metric: float) -> list[Work]:
        super().report(trial_id, batches, metric)
        bracket = self.brackets[self.bracket_of[trial_id]]
        budgets = bracket.budgets
        rung = budgets.index(batches) if batches in budgets else None
        if rung is None or rung == len(budgets) - 1:
            return []
        results = bracket.rung_results[rung]
        results[trial_id] = metric
        if self.stop_once:
            others = [m for t, m in results.items() if t != trial_id]
            better = sum(1 for m in others if (m < metric if self.smaller else m > metric))
            chosen = {trial_id} if better < max(int(len(results) // self.divisor), 1) else set()
        else:
            ranked = sorted(results.items(), key=lambda kv: kv[1] if self.smaller else -kv[1])
            chosen = {t for t, _ in ranked[: int(len(ranked) / self.divisor)]}
        out = []
        for candidate in sorted(chosen - bracket.promoted[rung]):
            bracket.promoted[rung].add(candidate)
            out.append(Work(candidate, self.created[candidate], budgets[rung + 1]))
        return out

    def report_invalid(self, trial_id: int) -> list[Work]:
        """Drop the trial from its bracket's rungs and start a replacement in that bracket."""
        super().report_invalid(trial_id)
        b = self.bracket_of.get(trial_id, 0)
        for rung in self.brackets[b].rung_results:
            rung.pop(trial_id, None)
        replacement = self._new_trial(b)
        return [replacement] if replacement else []

    def state(self) -> dict[str, Any]:
        base = super().state()
        base.update(
            {
                "bracket_of": {str(t): b for t, b in self.bracket_of.items()},
                "brackets": [
                    {
                        "rung_results": [
                            {str(t): m for t, m in r.items()} for r in bracket.rung_results
                        ],
                        "promoted": [sorted(p) for p in bracket.promoted],
                    }
                    for bracket in self.brackets
                ],
            }
        )  # hyperparameters are not kept: they replay from the seed, in trial order
        return base

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        if "brackets" not in state or len(state["brackets"]) != len(self.brackets):
            raise ConfigError(
                "the saved adaptive_asha state does not match this config's brackets (it was "
                "written by an older det-tasks or another config); start a new experiment run"
            )
        self.bracket_of = {int(t): int(b) for t, b in state["bracket_of"].items()}
        self.rng = random.Random(self.seed)
        self.created = {t: sample_hparams(self.space, self.rng) for t in sorted(self.bracket_of)}
        for b, (bracket, saved) in enumerate(zip(self.brackets, state["brackets"])):
            bracket.trials = {t for t, tb in self.bracket_of.items() if tb == b}
            bracket.rung_results = [
                {int(t): float(m) for t, m in r.items()} for r in saved["rung_results"]
            ]
            bracket.promoted = [set(p) for p in saved["promoted"]]


def _rung_lengths(max_batches: int, rungs: int, divisor: float) -> list[int]:
    base = max_batches / divisor ** (rungs - 1)
    lengths = [max(int(base * divisor**k), 1) for k in range(rungs)]
    lengths[-1] = max_batches
    return lengths
