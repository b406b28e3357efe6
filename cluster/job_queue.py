"""The shared cluster's job queue: a Dask scheduler plugin that decides, for every
experiment whose flow uses the scheduler, which of its trials may start and which must give
way (``cluster.fair_share``), and shows the queue to ``det job list``.

Decisions are made where every experiment is seen, the scheduler, whatever machine or user
started each flow. Each flow says at each wake-up what it runs and what it would start
(``sync``), and learns what it may start and what it must preempt: the flows' reports are
the truth, so the queue survives a flow run's restart (its job is dropped when its Dask client
leaves, or after STALE_AFTER_S without a word) and is rebuilt from the flows' next reports
after a scheduler restart. Flows reach it through Dask's own RPC (the handlers registered
below); ``det`` reaches it over the scheduler's HTTP server (cluster.queue_http), without
importing Dask.

``det experiment create`` queues the experiment the moment its flow run exists
(``preregister``): its trials wait in the queue with its priority and weight, so slots that
free while its flow is still starting are kept for it as fair share says. Its flow's first
report takes the same entry over (same key). A pre-registered job whose flow has not
reported within STALE_AFTER_S is dropped like any silent job: its slots go back to the
others, and its flow's first report, if it ever comes, queues it again.

A worker belongs to the resource pool named by its Dask resource ``pool-<name>`` (the
stack's workers: ``pool-default``); a cluster whose workers name none is one pool,
``default``. A pool's slots are its workers, or its GPUs where workers advertise ``GPU``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from distributed import Scheduler, SchedulerPlugin

from cluster.fair_share import DEFAULT_PRIORITY, JobDemand, decide, queue_order
from cluster.pools import DEFAULT_POOL, worker_pool

__all__ = ["JOB_QUEUE_NAME", "MIN_RUNTIME_ENV", "JobQueue"]

JOB_QUEUE_NAME = "det-tasks-job-queue"
# How long a trial runs before more urgent work may preempt it (Determined has no such
# guard; without one, two priorities trading slots would spend their time checkpointing).
MIN_RUNTIME_ENV = "DET_TASKS_PREEMPT_AFTER_S"
DEFAULT_MIN_RUNTIME_S = 30.0
STALE_AFTER_S = 120.0  # a job whose flow said nothing this long is dropped (it re-reports)


@dataclasses.dataclass
class _Job:
    key: str
    name: str
    user: str
    pool: str
    need: int
    max_trials: int
    client: str | None = None
    priority: int = DEFAULT_PRIORITY
    weight: float = 1.0
    max_slots: int | None = None
    submitted: float = dataclasses.field(default_factory=time.time)
    seen: float = dataclasses.field(default_factory=time.monotonic)
    running: dict[int, float] = dataclasses.field(default_factory=dict)
    waiting: tuple[int, ...] = ()
    preempting: set[int] = dataclasses.field(default_factory=set)
    paused: bool = False
    pending: bool = False  # queued by `det experiment create`; its flow has not reported yet
    slurm: dict[str, Any] | None = None  # its worker jobs' `slurm:` (cluster.slurm_workers)
    reason: str = ""

    def demand(self) -> JobDemand:
        return JobDemand(
            key=self.key,
            priority=self.priority,
            weight=self.weight,
            max_slots=self.max_slots,
            need=self.need,
            submitted=self.submitted,
            running=dict(self.running),
            waiting=() if self.paused else self.waiting,
            preempting=frozenset(self.preempting),
        )


SETTINGS = ("priority", "weight", "max_slots")


class JobQueue(SchedulerPlugin):
    """The queue's state on the scheduler (registered once per scheduler, idempotent)."""

    name = JOB_QUEUE_NAME
    idempotent = True

    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        # `det job update` / `det experiment set`: win over what the flow's config says.
        self.overrides: dict[str, dict[str, Any]] = {}
        self.min_runtime_s = DEFAULT_MIN_RUNTIME_S
        self.scheduler: Scheduler | None = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.min_runtime_s = float(os.environ.get(MIN_RUNTIME_ENV, DEFAULT_MIN_RUNTIME_S))
        scheduler.handlers.update(
            {
                "det_jobs_sync": self.sync,
                "det_jobs_end": self.end,
                "det_jobs_list": self.list_jobs,
                "det_jobs_update": self.update,
                "det_jobs_pools": self.pools,
            }
        )

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """A flow's client left (it ended or died): its running job goes; a paused one
        stays listed until it is activated, canceled or killed."""
        for key, job in list(self.jobs.items()):
            if job.client == client and not job.paused:
                del self.jobs[key]

    # ---- the flows' side ----------------------------------------------------------------
    def sync(
        self, key: str, job: dict[str, Any], waiting: list[int], running: list[int]
    ) -> dict[str, Any]:
        """A flow's report: its job's settings, the trials it runs and those it would
        start. Returns the trials it may start, those it must preempt, why the rest wait,
        and the job's settings in force (an update may have changed them)."""
        now = time.monotonic()
        entry = self._entry(key, job)
        entry.seen, entry.paused, entry.pending = now, False, False
        entry.running = {t: entry.running.get(t, now) for t in running}
        entry.preempting &= set(running)
        entry.waiting = tuple(waiting)
        self._drop_stale(now)
        pool = [j for j in self.jobs.values() if j.pool == entry.pool]
        decision = decide(
            [j.demand() for j in pool], self.capacity(entry.pool), now, self.min_runtime_s
        )
        for other in pool:
            other.preempting.update(decision.preempt.get(other.key, ()))
            other.reason = decision.reasons.get(other.key, "")
        granted = decision.grants.get(key, [])
        entry.running.update({t: now for t in granted})
        entry.waiting = tuple(t for t in entry.waiting if t not in granted)
        return {
            "grants": granted,
            "preempt": sorted(entry.preempting),
            "reason": entry.reason,
            "settings": {name: getattr(entry, name) for name in SETTINGS},
        }

    def end(self, key: str, paused: bool = False) -> bool:
        """The flow ends: a paused job stays listed (PAUSED, no slots); any other goes.
        True if the queue knew the job (every handler answers: None means no queue)."""
        job = self.jobs.get(key)
        if job is None:
            return False
        if paused:
            job.paused, job.running, job.waiting, job.preempting = True, {}, (), set()
        else:
            del self.jobs[key]
            self.overrides.pop(key, None)
        return True

    def preregister(self, key: str, job: dict[str, Any]) -> dict[str, Any]:
        """``det experiment create``: queue the experiment before its flow reports, its
        first ``max_trials`` trials waiting (a trial takes ``slots_per_trial`` GPUs in a pool
        of GPU workers, else one worker). A job already known (its flow reported first) is
        left as it is. Returns its key, whether it is new, and its settings in force."""
        known = key in self.jobs
        if not known:
            pool = str(job.get("pool", DEFAULT_POOL))
            gpus = any(ws.resources.get("GPU") for ws in self._workers()
                       if worker_pool(ws.resources) == pool)  # fmt: skip
            need = int(job.get("slots_per_trial", 1)) if gpus else 1
            entry = self._entry(key, {**job, "need": need})
            entry.pending, entry.seen = True, time.monotonic()
            entry.waiting = tuple(range(1, max(1, entry.max_trials) + 1))
        entry = self.jobs[key]
        settings = {name: getattr(entry, name) for name in SETTINGS}
        return {"key": key, "new": not known, "settings": settings}

    def _entry(self, key: str, report: dict[str, Any]) -> _Job:
        """The flow's job, its settings those it reports unless `det job update` set them
        (what the flow reports wins over what `det experiment create` queued)."""
        job = self.jobs.get(key)
        if job is None:
            job = self.jobs[key] = _Job(key=key, name=key, user="", pool=DEFAULT_POOL, need=1,
                                        max_trials=1)  # fmt: skip
        job.name = str(report.get("name", job.name))
        job.user = str(report.get("user", job.user))
        job.pool = str(report.get("pool", job.pool))
        job.need = int(report.get("need", job.need))
        job.max_trials = int(report.get("max_trials", job.max_trials))
        job.client = report.get("client", job.client)
        job.slurm = report.get("slurm", job.slurm)
        settings = {**report, **self.overrides.get(key, {})}
        job.priority = int(settings.get("priority", DEFAULT_PRIORITY))
        job.weight = float(settings.get("weight", 1.0))
        job.max_slots = settings.get("max_slots")
        return job

    def _drop_stale(self, now: float) -> None:
        for key, job in list(self.jobs.items()):
            if not job.paused and now - job.seen > STALE_AFTER_S:
                del self.jobs[key]

    # ---- what `det job` reads and changes ------------------------------------------------
    def list_jobs(self) -> list[dict[str, Any]]:
        """Every job in the order it is served, with its place and what it holds."""
        self._drop_stale(time.monotonic())
        active = [j for j in self.jobs.values() if not j.paused]
        order = {d.key: n for n, d in enumerate(queue_order([j.demand() for j in active]), 1)}
        rows = []
        for job in sorted(self.jobs.values(), key=lambda j: order.get(j.key, 1 << 30)):
            held = len(job.running) * job.need
            state = "PAUSED" if job.paused else ("SCHEDULED" if held else "QUEUED")
            rows.append(
                {
                    "key": job.key,
                    "name": job.name,
                    "user": job.user,
                    "pool": job.pool,
                    "state": state,
                    "priority": job.priority,
                    "weight": job.weight,
                    "max_slots": job.max_slots,
                    "held": held,
                    "wanted": held + len(job.waiting) * job.need,
                    "position": order.get(job.key),
                    "submitted": job.submitted,
                    "reason": job.reason,
                }
            )
        return rows

    def update(self, key: str, **settings: Any) -> dict[str, Any]:
        """Change a job's priority, weight or max_slots (``key``: its key or a unique
        prefix); in force at the next decision, which a raise can make a preemption."""
        matches = [k for k in self.jobs if k.startswith(key)]
        if len(matches) != 1:
            known = ", ".join(sorted(k[:8] for k in self.jobs)) or "none"
            return {"error": f"{len(matches)} job(s) match {key!r} (jobs: {known})"}
        job = self.jobs[matches[0]]
        changes = {k: v for k, v in settings.items() if k in SETTINGS}
        self.overrides.setdefault(job.key, {}).update(changes)
        for name, value in changes.items():
            setattr(job, name, value)
        return {"key": job.key, "settings": {name: getattr(job, name) for name in SETTINGS}}

    def pools(self) -> dict[str, int]:
        """Each pool's slots: the pools of the workers there are, and those a plugin starts
        workers for on demand (``elastic_pool``: cluster.slurm_workers), with 0 slots
        until it has."""
        names = {worker_pool(ws.resources) for ws in self._workers()}
        assert self.scheduler is not None
        elastic = (getattr(p, "elastic_pool", None) for p in self.scheduler.plugins.values())
        names |= {pool for pool in elastic if isinstance(pool, str)}
        return {name: self.capacity(name) for name in sorted(names)}

    def capacity(self, pool: str) -> int:
        workers = [ws for ws in self._workers() if worker_pool(ws.resources) == pool]
        gpus = sum(int(ws.resources.get("GPU", 0)) for ws in workers)
        return gpus if gpus else len(workers)

    def _workers(self) -> list[Any]:
        assert self.scheduler is not None
        return list(self.scheduler.workers.values())
