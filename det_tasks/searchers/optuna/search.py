"""``searcher.name: optuna``: model-based search (TPE, CMA-ES, GP, random, QMC) with
pruning at ASHA's rungs, ask-and-tell behind det_tasks' ``Searcher`` interface.

Each trial the study asks for becomes ``Work`` to its first rung; each ``report`` is one
validation at that rung, passed to the trial as an intermediate value; the pruner then
continues it to the next rung or prunes it (its chain ends, its worker is released). When
a trial ends, the next is asked for, so the study learns from every finished trial before
proposing another; at most ``max_concurrent_trials`` are open at once.

Why no Optuna storage: the study is rebuilt from the searcher state tag that the flow
already keeps on the MLflow parent run. The state is the ordered log of what the searcher
heard (reports and invalid trials); ``load`` replays it against a fresh study with the
same seeded sampler, which asks for the same trials at the same points, so a re-run or an
activated experiment continues the very study (the next proposals are those an
uninterrupted run would make). One source of truth, no second database, and MLflow's
backend may be behind a server the flow cannot reach with SQL. A fingerprint of every
replayed trial's parameters guards against a replay that diverges (another Optuna version
or search space).
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import Trial, TrialState

from det_tasks.config import ExperimentConfig
from det_tasks.errors import ConfigError
from det_tasks.searchers.base import MAX_INVALID_FACTOR, Searcher, Work
from det_tasks.searchers.optuna.space import SearchSpace, search_space

__all__ = ["OptunaSearcher", "make_optuna_searcher", "make_pruner", "make_sampler", "rungs"]

STUDY_NAME = "det-tasks"  # fixed: HyperbandPruner hashes it to place trials in brackets


def make_sampler(name: str, seed: int, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The sampler ``searcher.sampler`` names, seeded by experiment_seed."""
    if name == "tpe":
        # constant_liar: trials still running count as bad guesses, so concurrent asks
        # spread out instead of proposing the same point.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if name == "cmaes":
        if space.categorical():
            raise ConfigError(
                f"searcher.sampler cmaes cannot search categorical hyperparameters "
                f"(hyperparameters.{space.categorical()[0]}): use sampler: tpe or gp"
            )
        if len(space.numeric()) < 2:
            raise ConfigError(
                "searcher.sampler cmaes needs at least two int/double/log hyperparameters "
                f"(this space has {len(space.numeric())}): use sampler: tpe or gp"
            )
        return optuna.samplers.CmaEsSampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "qmc":
        # scrambled, so experiment_seed picks the sequence (unscrambled Sobol ignores it);
        # Optuna's "experimental" notice would print once per study, replays included.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(scramble=True, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"searcher.sampler {name!r} is unknown: use tpe, cmaes, gp, random or qmc")


def rungs(max_batches: int, divisor: float, max_rungs: int) -> list[int]:
    """Validation lengths, as AshaSearcher's one-bracket rungs: max_batches / divisor**k."""
    count = min(max_rungs, int(math.log(max(max_batches, 1)) / math.log(divisor)) + 1)
    base = max_batches / divisor ** (count - 1)
    lengths = [max(int(base * divisor**k), 1) for k in range(count)]
    lengths[-1] = max_batches
    return sorted(set(lengths))


def make_pruner(name: str, lengths: list[int], divisor: float) -> optuna.pruners.BasePruner:
    """The pruner ``searcher.pruner`` names, its rungs at ``lengths`` (in batches).

    Optuna's successive halving places rung k at ``min_resource * reduction_factor**k``;
    with min_resource the first length and an integer divisor, every length from
    ``rungs`` falls in its own rung, so each validation is judged exactly once.
    """
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner()
    if divisor != int(divisor):
        raise ConfigError(
            f"searcher.divisor {divisor} must be a whole number for pruner: {name} "
            "(Optuna's reduction_factor), e.g. divisor: 4"
        )
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=lengths[0], reduction_factor=int(divisor)
        )
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=lengths[0], max_resource=lengths[-1], reduction_factor=int(divisor)
        )
    raise ConfigError(f"searcher.pruner {name!r} is unknown: use none, asha, hyperband or median")


class OptunaSearcher(Searcher):
    """Ask-and-tell over an in-memory Optuna study; trial ids are Optuna's numbers + 1."""

    def __init__(
        self,
        new_study: Callable[[], optuna.Study],
        space: SearchSpace,
        lengths: list[int | None],
        max_trials: int,
        concurrency: int,
    ) -> None:
        super().__init__([], lengths[-1])
        self._new_study = new_study
        self.space = space
        self.lengths = lengths
        self.max_trials = max_trials
        self.concurrency = max(1, concurrency)
        self._reset()

    def _reset(self) -> None:
        self.study = self._new_study()
        self.results, self.invalid = {}, set()
        self.created: dict[int, dict[str, Any]] = {}
        self.open: dict[int, Trial] = {}  # asked, not yet told
        self.rung: dict[int, int] = {}  # index of the length each open trial trains to
        self.ended: set[int] = set()
        self._pruned: set[int] = set()
        self.events: list[list[Any]] = []  # [trial, batches, metric] or [trial] (invalid)

    # ---- the Searcher interface --------------------------------------------------------
    def start(self) -> list[Work]:
        """Open trials' next segments (after load), then new trials up to the concurrency."""
        pending = [self._work(t) for t in sorted(self.open)]
        return pending + self._fill()

    def report(self, trial_id: int, batches: int, metric: float) -> list[Work]:
        self.events.append([trial_id, batches, metric])
        return self._heard(trial_id, batches, metric)

    def report_invalid(self, trial_id: int) -> list[Work]:
        self.events.append([trial_id])
        return self._heard_invalid(trial_id)

    def finished(self) -> set[int]:
        return self.ended | self.invalid

    def pruned(self) -> frozenset[int]:
        return frozenset(self._pruned)

    def state(self) -> dict[str, Any]:
        return {"optuna_events": self.events, "fingerprint": self._fingerprint()}

    def load(self, state: dict[str, Any]) -> None:
        """Rebuild the study by replaying what the saved searcher heard, in order."""
        if "optuna_events" not in state:
            raise ConfigError(
                "the saved searcher state is not an optuna study's (the experiment ran with "
                "another searcher); start a new experiment run"
            )
        self._reset()
        self._fill()
        for event in state["optuna_events"]:
            if len(event) == 1:
                self.report_invalid(int(event[0]))
            else:
                self.report(int(event[0]), int(event[1]), float(event[2]))
        if self._fingerprint() != state.get("fingerprint"):
            raise ConfigError(
                "the saved optuna study does not replay to the same trials (the Optuna "
                "version, experiment_seed or search space changed since it was saved); start "
                "a new experiment run"
            )

    # ---- the study -------------------------------------------------------------------------
    def _work(self, trial_id: int) -> Work:
        return Work(trial_id, self.created[trial_id], self.lengths[self.rung[trial_id]])

    def _fill(self) -> list[Work]:
        out = []
        while len(self.open) < self.concurrency and self._may_ask():
            trial = self.study.ask(self.space.distributions)
            trial_id = trial.number + 1
            self.created[trial_id] = self.space.hparams(trial.params)
            self.open[trial_id], self.rung[trial_id] = trial, 0
            out.append(self._work(trial_id))
        return out

    def _may_ask(self) -> bool:
        valid = len(self.created) - len(self.invalid)
        return valid < self.max_trials and len(self.invalid) <= MAX_INVALID_FACTOR * self.max_trials

    def _heard(self, trial_id: int, batches: int, metric: float) -> list[Work]:
        super().report(trial_id, batches, metric)
        trial = self.open.get(trial_id)
        if trial is None:  # a segment of a trial already told: nothing to decide
            return []
        last = self.rung[trial_id] == len(self.lengths) - 1
        if not math.isfinite(metric):  # a diverged trial teaches nothing: failed, not ranked
            self.study.tell(trial, state=TrialState.FAIL)
        elif last:
            self.study.tell(trial, metric)
        else:
            trial.report(metric, batches)
            if not trial.should_prune():
                self.rung[trial_id] += 1
                return [self._work(trial_id)]
            self.study.tell(trial, state=TrialState.PRUNED)
            self._pruned.add(trial_id)
        self._close(trial_id)
        return self._fill()

    def _heard_invalid(self, trial_id: int) -> list[Work]:
        super().report_invalid(trial_id)
        if trial_id in self.open:
            self.study.tell(self.open[trial_id], state=TrialState.FAIL)
            self._close(trial_id)
        return self._fill()

    def _close(self, trial_id: int) -> None:
        del self.open[trial_id]
        self.ended.add(trial_id)

    def _fingerprint(self) -> str:
        text = json.dumps([self.created[t] for t in sorted(self.created)], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_optuna_searcher(
    config: ExperimentConfig,
    max_batches: int | None,
    sampler: str = "tpe",
    pruner: str = "asha",
) -> OptunaSearcher:
    """The searcher ``searcher.name: optuna`` names (built through its plug-in, ``options``)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per trial told
    s, seed = config.searcher, config.reproducibility.experiment_seed
    assert s.max_trials is not None  # the config model requires it for optuna
    space = search_space(config.hyperparameters)
    if not space.distributions:
        raise ConfigError(
            "searcher.name optuna: hyperparameters has nothing to search (only constants); "
            "give a searchable hyperparameter or use searcher.name: single"
        )
    make_sampler(sampler, seed, space)  # config errors now, before any study
    lengths: list[int | None] = [max_batches]
    if pruner != "none":
        if max_batches is None:
            max_batches = config.max_length_in_batches()
        if max_batches is None:  # refused when the config was read; kept for a bypass
            raise ConfigError(
                f"searcher.pruner {pruner} validates at rungs counted in batches: add "
                "records_per_epoch, or give max_length in batches or records, or use pruner: none"
            )
        lengths = list(rungs(max_batches, s.divisor, s.max_rungs))
    pruner_lengths = [n for n in lengths if n is not None] or [1]
    make_pruner(pruner, pruner_lengths, s.divisor)

    def new_study() -> optuna.Study:
        return optuna.create_study(
            study_name=STUDY_NAME,
            direction="minimize" if s.smaller_is_better else "maximize",
            sampler=make_sampler(sampler, seed, space),
            pruner=make_pruner(pruner, pruner_lengths, s.divisor),
        )

    return OptunaSearcher(new_study, space, lengths, s.max_trials, s.max_concurrent_trials)
