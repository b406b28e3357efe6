"""What every searcher is: it hands out ``Work`` (train trial T until batch B) and hears back
each trial's searcher metric at that length; it never trains anything itself. Its state is a
JSON-able dict, so an orchestrator can persist it and resume a crashed experiment without
re-running finished work. The base class is Determined's ``single`` and ``grid``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MAX_INVALID_FACTOR", "Searcher", "Work"]

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

    def pruned(self) -> frozenset[int]:
        """Trials a model-based searcher's pruner ended early (shown PRUNED, not STOPPED)."""
        return frozenset()

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
