"""Who gets the pool's free slots, and whose trials give theirs back: Determined's priority
scheduler with its fair share inside each priority, as one pure function.

- Priorities run from 1 (most urgent) to 99; more urgent waiting work takes free slots
  first.
- Within a priority, each free slot goes to the experiment holding the fewest slots per unit
  of ``weight``, so two experiments of weights 1 and 3 settle at 1 and 3 slots of 4; a share
  one experiment cannot use (its trials, ``max_slots`` or ``max_concurrent_trials``) goes to
  the others. Nobody is preempted to rebalance a share: a new experiment gets its share as
  slots free.
- Waiting work that finds no free slot preempts trials of less urgent priorities, least
  urgent and most recently started first, but only those that have run
  ``min_runtime_s`` (a guard against thrashing). The slots they free go to the most urgent
  waiting work, since every decision serves priorities in order.

No Dask here: ``cluster.job_queue`` keeps the state on the scheduler and calls ``decide``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "DEFAULT_PRIORITY",
    "Decision",
    "JobDemand",
    "decide",
    "queue_order",
]

DEFAULT_PRIORITY = 42  # Determined's default
DEFAULT_WEIGHT = 1.0


@dataclasses.dataclass(frozen=True)
class JobDemand:
    """One experiment as a scheduling decision sees it."""

    key: str
    priority: int = DEFAULT_PRIORITY
    weight: float = DEFAULT_WEIGHT
    max_slots: int | None = None
    need: int = 1  # slots one trial takes (GPUs per trial on GPU workers, else 1 worker)
    submitted: float = 0.0  # first seen: the tie-breaker between equals
    running: dict[int, float] = dataclasses.field(default_factory=dict)  # trial -> started
    waiting: tuple[int, ...] = ()  # trials its flow would start now, in its order
    preempting: frozenset[int] = frozenset()  # running trials already asked to give way

    @property
    def held(self) -> int:
        return len(self.running) * self.need


@dataclasses.dataclass
class Decision:
    """What one scheduling decision says: trials that start, trials that give way, and why
    the rest wait (per experiment)."""

    grants: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    preempt: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)


def queue_order(jobs: Sequence[JobDemand]) -> list[JobDemand]:
    """The jobs in the order they are served: priority, then fewest slots per weight, then
    first submitted (what ``det job list`` shows as the position)."""
    return sorted(jobs, key=lambda j: (j.priority, j.held / j.weight, j.submitted, j.key))


def decide(jobs: Sequence[JobDemand], capacity: int, now: float, min_runtime_s: float) -> Decision:
    """One decision over a pool of ``capacity`` slots (``now`` and each trial's start on
    the same clock)."""
    held = {j.key: j.held for j in jobs}
    decision = Decision()
    blocked = False  # more urgent work waits: nothing less urgent starts
    for level in sorted({j.priority for j in jobs}):
        at_level = [j for j in jobs if j.priority == level]
        if blocked:
            _note_waiting([j for j in at_level if j.waiting], jobs, decision, min_runtime_s)
            continue
        left = {j.key: list(j.waiting) for j in at_level}
        free = capacity - sum(held.values())
        unmet = _fill(at_level, left, held, free, decision)
        if unmet:
            blocked = True
            wanted = sum(_still_wanted(j, left[j.key], held[j.key]) for j in unmet)
            free = capacity - sum(held.values())
            _preempt_for(wanted - free, level, jobs, now, min_runtime_s, decision)
            _note_waiting(unmet, jobs, decision, min_runtime_s)
    return decision


def _fill(
    at_level: list[JobDemand],
    left: dict[str, list[int]],
    held: dict[str, int],
    free: int,
    decision: Decision,
) -> list[JobDemand]:
    """Give free slots one at a time to the level's neediest experiment; returns the jobs
    still waiting for a slot they may take (not those held back by their own caps)."""
    while True:
        takers = [j for j in at_level if left[j.key] and _allowed(j, held)]
        if not takers:
            _note_capped(at_level, left, held, decision)
            return []
        job = min(takers, key=lambda j: (held[j.key] / j.weight, j.submitted, j.key))
        if free < job.need:
            _note_capped(at_level, left, held, decision)
            return takers
        trial = left[job.key].pop(0)
        decision.grants.setdefault(job.key, []).append(trial)
        held[job.key] += job.need
        free -= job.need


def _still_wanted(job: JobDemand, left: list[int], held: int) -> int:
    """Slots the job's waiting trials would take, within its max_slots."""
    trials = len(left)
    if job.max_slots is not None:
        trials = min(trials, max(0, job.max_slots - held) // job.need)
    return trials * job.need


def _allowed(job: JobDemand, held: dict[str, int]) -> bool:
    return job.max_slots is None or held[job.key] + job.need <= job.max_slots


def _preempt_for(
    short: int,
    level: int,
    jobs: Sequence[JobDemand],
    now: float,
    min_runtime_s: float,
    decision: Decision,
) -> None:
    """Ask less urgent trials to give way until ``short`` more slots are coming, counting
    those that trials already asked will free."""
    lower = [j for j in jobs if j.priority > level]
    short -= sum(len(j.preempting & set(j.running)) * j.need for j in lower)
    victims = sorted(
        (
            (j.priority, started, j.key, trial, j.need)
            for j in lower
            for trial, started in j.running.items()
            if trial not in j.preempting and now - started >= min_runtime_s
        ),
        key=lambda v: (-v[0], -v[1]),
    )
    for _, _, key, trial, need in victims:
        if short <= 0:
            return
        decision.preempt.setdefault(key, []).append(trial)
        short -= need


def _note_waiting(
    waiting: list[JobDemand], jobs: Sequence[JobDemand], decision: Decision, min_runtime_s: float
) -> None:
    for job in waiting:
        ahead = [
            j
            for j in jobs
            if j.key != job.key and j.priority <= job.priority and (j.running or j.waiting)
        ]
        reason = (
            f"waiting for a slot: {len(ahead)} experiment(s) ahead at priority "
            f"{job.priority} or more urgent"
        )
        if any(j.running for j in jobs if j.priority > job.priority):
            reason += f"; less urgent trials give way once they have run {min_runtime_s:.0f} s"
        decision.reasons.setdefault(job.key, reason)


def _note_capped(
    at_level: list[JobDemand],
    left: dict[str, list[int]],
    held: dict[str, int],
    decision: Decision,
) -> None:
    for job in at_level:
        if left[job.key] and not _allowed(job, held):
            decision.reasons.setdefault(
                job.key, f"at its resources.max_slots ({job.max_slots} slot(s) held)"
            )
