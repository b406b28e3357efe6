"""What happened to a trial, in one vocabulary for MLflow's ``det.state`` tag, the Prefect
trials table and ``det-tasks experiment describe``: Determined's words, plus STOPPED for a
trial the searcher ended early (ASHA did not promote it) and PRUNED for one an optuna
pruner ended.

MLflow's run status stays honest beside it: COMPLETED, STOPPED and PRUNED runs are FINISHED (a
searcher stop is a normal end, as Optuna's MLflow callback ends a pruned trial FINISHED with
``state=PRUNED``), PAUSED and CANCELED runs KILLED, ERROR runs FAILED.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ACTIVE",
    "CANCELED",
    "COMPLETED",
    "END_STATES",
    "ERROR",
    "ORPHANED",
    "PAUSED",
    "PREEMPTED",
    "Progress",
    "PRUNED",
    "QUEUED",
    "RUNNING",
    "STOPPED",
    "honest_end",
    "run_status",
    "trial_state",
]

ACTIVE = "ACTIVE"  # reopened: a promoted, resumed or activated trial runs again
RUNNING = "RUNNING"
COMPLETED = "COMPLETED"  # trained to searcher.max_length
STOPPED = "STOPPED"  # the searcher ended it before max_length
PRUNED = "PRUNED"  # an optuna searcher's pruner ended it (flows.trial_table.PRUNED)
ERROR = "ERROR"
CANCELED = "CANCELED"
PAUSED = "PAUSED"
ORPHANED = "ORPHANED"  # its flow died without a word (registry.runs.run_states.end_orphans)
# Waiting for a slot of the shared cluster (cluster.job_queue): its run is RUNNING, as the
# experiment's; PREEMPTED gave its slot to more urgent work at a checkpoint (its run KILLED
# until it resumes, when it is reopened).
QUEUED = "QUEUED"
PREEMPTED = "PREEMPTED"

END_STATES = frozenset({COMPLETED, STOPPED, PRUNED, ERROR, CANCELED, PAUSED, ORPHANED})

# A run without a det.state tag (written before the tag existed, or by hand): its status.
_BY_STATUS = {"FINISHED": COMPLETED, "FAILED": ERROR, "KILLED": CANCELED}
# The MLflow status of a run that ended in each state (the rule in this module's docstring).
_STATUS = {
    COMPLETED: "FINISHED",
    STOPPED: "FINISHED",
    PRUNED: "FINISHED",
    ERROR: "FAILED",
    CANCELED: "KILLED",
    PAUSED: "KILLED",
    ORPHANED: "KILLED",
    PREEMPTED: "KILLED",
}


def run_status(state: str, default: str) -> str:
    """The MLflow status a run ending in ``state`` gets (``default`` for another word)."""
    return _STATUS.get(state, default)


def trial_state(status: str, tag: str | None) -> str:
    """The state word of a trial run with MLflow ``status`` and ``det.state`` ``tag``."""
    if status in ("RUNNING", "SCHEDULED"):
        return QUEUED if tag == QUEUED else RUNNING
    if tag in END_STATES or tag == PREEMPTED:
        return tag
    return _BY_STATUS.get(status, status)


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a trial got when its run ends: batches ``trained`` of its searcher ``length``
    (None: unknown), and whether the trial itself asked to stop early
    (``context.set_stop_requested``, a normal end in Determined)."""

    trained: int
    length: int | None
    stop_requested: bool = False

    @property
    def complete(self) -> bool:
        return self.stop_requested or (self.length is not None and self.trained >= self.length)

    @classmethod
    def recorded_elsewhere(cls) -> Progress:
        """Work that finished before it was recorded here (an imported checkpoint)."""
        return cls(trained=0, length=0)


def honest_end(state: str, progress: Progress | None) -> tuple[str, str | None]:
    """The state a trial run may end in, and why it was changed (None: as asked).

    The one rule every ending of a trial run goes through: COMPLETED only once the trial
    trained its searcher length (or stopped itself early). A run asked to end COMPLETED
    short of that (its worker closed under it: a scheduler restart, a recycled or lost
    worker) ends PAUSED instead, saying where it stopped; it continues from its newest
    checkpoint, and nothing ever reads it as finished."""
    if state != COMPLETED or (progress is not None and progress.complete):
        return state, None
    where = (
        "at an unknown batch"
        if progress is None
        else f"at batch {progress.trained} of {progress.length if progress.length else '?'}"
    )
    return PAUSED, (
        f"its run was ended {where}, short of its searcher length, without a stop request "
        "(its worker closed or its process ended); it continues from its newest checkpoint"
    )
