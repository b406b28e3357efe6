"""Determined's ``random`` searcher: sampled trials, each trained to max_length."""

from __future__ import annotations

import random
from typing import Any

from det_tasks.config.hyperparameters import sample_hparams
from det_tasks.searchers.base import MAX_INVALID_FACTOR, Searcher, Work

__all__ = ["RandomSearcher"]


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
        # Only the count: the samples replay from the seed (the state is kept in an MLflow
        # tag, a few kB at most).
        return {**super().state(), "sampled": len(self.trials)}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        for _ in range(int(state.get("sampled", len(self.trials))) - len(self.trials)):
            self.trials.append(sample_hparams(self.space, self.rng))
