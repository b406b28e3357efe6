"""Which workers each trial's next step may start on (Dask worker restrictions, loose: if
they are gone Dask runs the step elsewhere and the step restores the trial from its
checkpoint). Dask does the scheduling; this only keeps a trial on the worker that holds it
in memory, and off workers another experiment's active trial holds. A trial that has no
worker of its own is given every suitable one and Dask starts it on the least busy: the
scheduler sees every experiment's steps at once, so two flows placing a trial at the same
moment are spread over two workers (each flow alone could only see what was already held,
and both chose the same worker while the other stood idle). Until the scheduler says which
of them a trial's step went to, that trial counts as claiming them all: no other trial of
the experiment is pinned to one of them alone (a CI run's test_shared_stack: a new trial
pinned to the worker an earlier one was still training on, and the two evicted each other
at every step). A trial placed while another of the experiment's offered trials has no
worker yet waits a moment for the scheduler to place that one first: offered the same
workers, both were started on one of them by Dask, which judges by its estimates of what
each worker has queued, and evicted each other while the other worker stood idle."""

from __future__ import annotations

import time
from typing import Any

from distributed import Client

from cluster.pools import DEFAULT_POOL, worker_pool
from cluster.steps import trials_running
from cluster.worker_calls import holds_foreign_trial

__all__ = ["PLACED_WAIT_S", "Placement"]

# How long a trial's placement waits for the step of another trial offered the same
# workers to reach one (the other trial's Prefect task starting and submitting it: tens of
# milliseconds idle); past it, the trial is offered the free workers as before.
PLACED_WAIT_S = 1.0
PLACED_POLL_S = 0.02


class Placement:
    """Where each trial's segments may start: the worker that holds it, while no other
    running trial has claimed it; otherwise the workers no running trial has claimed and
    none of this experiment's other trials is held on (Dask starts it on the least busy),
    else one that holds such a trial, else any (every worker is claimed: Dask chooses)."""

    def __init__(
        self,
        client: Client,
        experiment_key: str | None = None,
        pool: str = DEFAULT_POOL,
        on_demand: bool = False,
    ) -> None:
        self.client = client
        self.experiment_key = experiment_key
        self.pool = pool
        # The pool's workers are started when the job queue wants them (cluster.slurm_workers).
        self.on_demand = on_demand
        self.home: dict[int, str] = {}
        self.claimed: dict[str, int] = {}
        # Trials whose segment was offered several workers, until the scheduler places it.
        self.offered: dict[int, list[str]] = {}
        # Workers being recycled (cluster.recycling): given nothing until they are back.
        self.retiring: set[str] = set()
        self.gpus = any(w.get("resources", {}).get("GPU") for w in self._pool().values())

    def _pool(self) -> dict[str, dict[str, Any]]:
        """The workers of the experiment's resource pool (cluster.job_queue), by address."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        return {
            address: info
            for address, info in workers.items()
            if worker_pool(info.get("resources", {})) == self.pool
        }

    def workers(self) -> list[str]:
        """The pool's workers that can take a step now."""
        return [w for w in self._pool() if w not in self.retiring]

    def claim(self, trial_id: int) -> list[str] | None:
        """The workers the trial's next segment may start on (None: any). Several where
        none holds a trial of this experiment (which of them is busy with another
        experiment's step just submitted, only the scheduler knows), or where a trial not
        yet placed may take the one this flow would choose."""
        if self._settle_offered() - {trial_id}:
            self._await_placed(trial_id)
        workers = self.workers()
        contended = {w for t, ws in self.offered.items() if t != trial_id for w in ws}
        home = self.home.get(trial_id)
        if home in workers and home not in self.claimed and home not in contended:
            self.claimed[home] = trial_id
            return [home]
        taken = self._held_by_other_experiments()
        free = [w for w in workers if w not in self.claimed and w not in taken]
        others = {w for t, w in self.home.items() if t != trial_id}
        holding_none = [w for w in free if w not in others]
        # One left, or only workers holding this experiment's other trials: the flow knows
        # all it needs to choose (and one of those trials is evicted), unless a trial not
        # yet placed may take that worker: then the scheduler chooses, among every free one.
        choice = holding_none if len(holding_none) > 1 else (holding_none or free)[:1]
        unsettled = bool(contended.intersection(choice))
        if unsettled:
            choice = free
        if unsettled or len(choice) > 1:
            self.offered[trial_id] = choice  # claimed once its step is placed
            return choice
        if not choice:
            return None
        self.claimed[choice[0]] = trial_id
        return choice

    def _settle_offered(self) -> set[int]:
        """Claim, for each trial offered several workers, the one running its step (the
        scheduler's choice); one placed where another trial is claimed stays offered until
        that trial is done. Returns the offered trials whose step is on no worker yet."""
        if not self.offered:
            return set()
        try:
            running = trials_running(self.client, self.experiment_key, list(self.offered))
        except Exception:  # the scheduler away: they stay offered (none pinned onto them)
            return set()
        for trial_id, (worker, *_) in running.items():
            if self.claimed.setdefault(worker, trial_id) == trial_id:
                del self.offered[trial_id]
        return set(self.offered) - set(running)

    def _await_placed(self, trial_id: int) -> None:
        """Wait, at most PLACED_WAIT_S, until the steps of this experiment's other offered
        trials are on workers, so that this trial is placed knowing where they went. Two
        trials offered the same workers at once were both started on one of them by Dask
        (the other looked busier, with a release step queued on it) and evicted each other
        at every step while that worker stood idle (a CI run's test_asha_stops_worse_
        trials_early)."""
        deadline = time.monotonic() + PLACED_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(PLACED_POLL_S)
            if not self._settle_offered() - {trial_id}:
                return

    def _held_by_other_experiments(self) -> set[str]:
        """Workers holding another experiment's active trial (a shared cluster): pinning a
        step there would only queue it behind that trial's chain."""
        try:
            answers = self.client.run(holds_foreign_trial, self.experiment_key)
        except Exception:  # a worker leaving mid-call: place as if none were taken
            return set()
        return {worker for worker, held in answers.items() if held is True}

    def ran(self, trial_id: int, worker: str) -> None:
        """The trial's step ran on ``worker``: it holds the trial now (and nothing else)."""
        self.home = {t: w for t, w in self.home.items() if w != worker}
        self.home[trial_id] = worker
        self.claimed = {w: t for w, t in self.claimed.items() if t != trial_id}
        self.claimed.setdefault(worker, trial_id)
        self.offered.pop(trial_id, None)

    def released(self, trial_id: int) -> None:
        """The trial was released (it ended, or waits unheld): its worker no longer holds
        it, so it neither draws the trial back there nor keeps this experiment's new
        trials off that worker."""
        self.home.pop(trial_id, None)

    def done(self, trial_id: int) -> None:
        """The trial's segment ended: its worker may take another trial."""
        self.claimed = {w: t for w, t in self.claimed.items() if t != trial_id}
        self.offered.pop(trial_id, None)
