"""Hyperparameter searchers: single, grid, random and adaptive ASHA, as pure logic.

A searcher hands out ``Work`` (train trial T until batch B) and hears back each trial's
searcher metric at that length; it never trains anything itself. Its state is a JSON-able
dict, so an orchestrator can persist it and resume a crashed experiment without
re-running finished work.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any

from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.hyperparameters import grid_values, sample_hparams
from det_tasks.errors import ConfigError

__all__ = [
    "MAX_INVALID_FACTOR",
    "AshaSearcher",
    "RandomSearcher",
    "Searcher",
    "Work",
    "make_searcher",
]

MAX_INVALID_FACTOR = 10


@dataclasses.dataclass(frozen=True)
class Work:
    """Train ``trial_id`` (with ``hparams``) until ``batches`` batches in total."""

    trial_id: int
    hparams: dict[str, Any]
    batches: int | None  # None: the config's searcher.max_length


class Searcher:
    """single / grid: every trial trains to max_length once."""

    def __init__(self, trials: list[dict[str, Any]], max_batches: int | None) -> None:
        self.trials = trials
        self.max_batches = max_batches
        self.results: dict[int, dict[int, float]] = {}
        self.invalid: set[int] = set()

    def start(self) -> list[Work]:
        return [Work(i + 1, hp, self.max_batches) for i, hp in enumerate(self.trials)]

    def report(self, trial_id: int, batches: int, metric: float) -> list[Work]:
        self.results.setdefault(trial_id, {})[batches] = metric
        return []

    def report_invalid(self, trial_id: int) -> list[Work]:
        """The trial raised ``det.InvalidHP``: drop it (its results no longer count).
        single and grid propose nothing instead, as in Determined."""
        self.invalid.add(trial_id)
        self.results.pop(trial_id, None)
        return []

    def finished(self) -> set[int]:
        """Trials with a result at their final length, or dropped as invalid (skipped when
        an experiment resumes)."""
        return set(self.results) | self.invalid

    def state(self) -> dict[str, Any]:
        return {
            "results": {str(t): {str(b): m for b, m in r.items()} for t, r in self.results.items()},
            "invalid": sorted(self.invalid),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.results = {
            int(t): {int(b): float(m) for b, m in r.items()}
            for t, r in state.get("results", {}).items()
        }
        self.invalid = {int(t) for t in state.get("invalid", [])}


class RandomSearcher(Searcher):
    """random: max_trials sampled trials, each to max_length; a trial dropped for invalid
    hyperparameters is replaced by a fresh sample (Determined's random searcher does the
    same), up to MAX_INVALID_FACTOR * max_trials replacements."""

    def __init__(self, space: dict[str, Any], seed: int, max_trials: int, max_batches: int | None):
        self.rng = random.Random(seed)
        self.space = space
        super().__init__([sample_hparams(space, self.rng) for _ in range(max_trials)], max_batches)
        self.replacement_budget = MAX_INVALID_FACTOR * max_trials

    def report_invalid(self, trial_id: int) -> list[Work]:
        super().report_invalid(trial_id)
        if len(self.invalid) > self.replacement_budget:
            return []
        self.trials.append(sample_hparams(self.space, self.rng))
        return [Work(len(self.trials), self.trials[-1], self.max_batches)]

    def state(self) -> dict[str, Any]:
        return {**super().state(), "trials": self.trials, "rng": self.rng.getstate()[1]}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        if "trials" in state:
            self.trials = list(state["trials"])
            self.rng.setstate((3, tuple(state["rng"]), None))


class AshaSearcher(Searcher):
    """Asynchronous successive halving (Determined's adaptive_asha, one bracket).

    Rung k trains to ``max_batches / divisor**(rungs-1-k)``; a trial finishing rung k is
    promoted when it is in the top ``1/divisor`` of the trials that have finished rung k;
    otherwise a new trial starts (until max_trials) and the trial stops there.

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
    ) -> None:
        self.stop_once = stop_once
        rungs = max(1, min(max_rungs, int(math.log(max(max_batches, 1), divisor)) + 1))
        self.budgets = [
            max(1, round(max_batches / divisor ** (rungs - 1 - k))) for k in range(rungs)
        ]
        self.budgets[-1] = max_batches
        self.rng = random.Random(seed)
        self.space = space
        self.max_trials = max_trials
        self.divisor = divisor
        self.smaller = smaller_is_better
        self.created: dict[int, dict[str, Any]] = {}
        self.rung_results: list[dict[int, float]] = [{} for _ in self.budgets]
        self.promoted: list[set[int]] = [set() for _ in self.budgets]
        super().__init__([], max_batches)

    def _new_trial(self) -> Work | None:
        if len(self.created) - len(self.invalid) >= self.max_trials:
            return None
        if len(self.invalid) > MAX_INVALID_FACTOR * self.max_trials:
            return None
        trial_id = len(self.created) + 1
        self.created[trial_id] = sample_hparams(self.space, self.rng)
        return Work(trial_id, self.created[trial_id], self.budgets[0])

    def start(self) -> list[Work]:
        return [w for w in (self._new_trial() for _ in range(self.max_trials)) if w]

    def report(self, trial_id: int, batches: int, metric: float) -> list[Work]:
        super().report(trial_id, batches, metric)
        rung = self.budgets.index(batches) if batches in self.budgets else None
        if rung is None or rung == len(self.budgets) - 1:
            return []
        self.rung_results[rung][trial_id] = metric
        if self.stop_once:
            return self._continue_or_stop(rung, trial_id, metric)
        ranked = sorted(
            self.rung_results[rung].items(), key=lambda kv: kv[1] if self.smaller else -kv[1]
        )
        top = {t for t, _ in ranked[: int(len(ranked) / self.divisor)]}
        out = []
        for candidate in sorted(top - self.promoted[rung]):
            self.promoted[rung].add(candidate)
            out.append(Work(candidate, self.created[candidate], self.budgets[rung + 1]))
        return out

    def _continue_or_stop(self, rung: int, trial_id: int, metric: float) -> list[Work]:
        others = [m for t, m in self.rung_results[rung].items() if t != trial_id]
        better = sum(1 for m in others if (m < metric if self.smaller else m > metric))
        if better >= max(int(len(self.rung_results[rung]) // self.divisor), 1):
            return []
        self.promoted[rung].add(trial_id)
        return [Work(trial_id, self.created[trial_id], self.budgets[rung + 1])]

    def report_invalid(self, trial_id: int) -> list[Work]:
        """Drop the trial from every rung and start a replacement trial at rung 0."""
        super().report_invalid(trial_id)
        for rung in self.rung_results:
            rung.pop(trial_id, None)
        replacement = self._new_trial()
        return [replacement] if replacement else []

    def state(self) -> dict[str, Any]:
        base = super().state()
        base.update(
            {
                "created": {str(t): hp for t, hp in self.created.items()},
                "rung_results": [{str(t): m for t, m in r.items()} for r in self.rung_results],
                "promoted": [sorted(p) for p in self.promoted],
                "rng": self.rng.getstate()[1],
            }
        )
        return base

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self.created = {int(t): hp for t, hp in state["created"].items()}
        self.rung_results = [
            {int(t): float(m) for t, m in r.items()} for r in state["rung_results"]
        ]
        self.promoted = [set(p) for p in state["promoted"]]
        self.rng.setstate((3, tuple(state["rng"]), None))


def _grid(space: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    leaves: list[tuple[list[str], list[Any]]] = []

    def walk(node: dict[str, Any], path: list[str]) -> None:
        for name, value in node.items():
            if isinstance(value, dict):
                walk(value, [*path, name])
            else:
                try:
                    leaves.append(([*path, name], grid_values(value)))
                except ValueError as err:
                    raise ConfigError(f"hyperparameters.{'.'.join([*path, name])}: {err}") from None

    walk(space, [])
    trials = []
    for combo in itertools.product(*(values for _, values in leaves)):
        hp: dict[str, Any] = {}
        for (path, _), value in zip(leaves, combo):
            node = hp
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        trials.append(hp)
    return trials


def make_searcher(config: ExperimentConfig, max_batches: int | None = None) -> Searcher:
    """The searcher the config names, with trials fixed by experiment_seed.

    ``max_batches`` None trains single/grid/random trials to the config's max_length
    (epochs included); ASHA needs its length in batches to place its rungs.
    """
    s, seed = config.searcher, config.reproducibility.experiment_seed
    space = config.hyperparameters
    if s.name == "single":
        return Searcher([sample_hparams(space, random.Random(seed))], max_batches)
    if s.name == "grid":
        trials = _grid(space)
        if s.max_trials is not None:
            trials = trials[: s.max_trials]
        return Searcher(trials, max_batches)
    if s.name == "random":
        assert s.max_trials is not None
        return RandomSearcher(space, seed, s.max_trials, max_batches)
    if s.name == "adaptive_asha":
        assert s.max_trials is not None
        length = config.max_length
        if max_batches is None:
            if length.unit != "batches":
                raise ConfigError(
                    "adaptive_asha needs its length in batches to place rungs: use "
                    "time_metric: batches with max_time, or max_length: {batches: N}"
                )
            max_batches = length.value
        return AshaSearcher(
            space,
            seed,
            max_batches,
            s.max_trials,
            s.divisor,
            s.max_rungs,
            s.smaller_is_better,
            stop_once=s.stop_once,
        )
    raise ConfigError(
        f"searcher.name {s.name!r} is not supported by det-tasks flows; use "
        "single, grid, random or adaptive_asha"
    )
