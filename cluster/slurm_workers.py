"""Dask workers as Slurm jobs: a scheduler plugin that asks Slurm, through dask-jobqueue's
``SLURMJob``, for as many det-tasks worker jobs as the job queue's experiments want, and
gives back the ones that sit idle.

Slurm decides which nodes the platform gets; the job queue (``cluster.job_queue``) still
decides which trials run on them. Every ``TICK_S`` the plugin adds the slots the queue's
active experiments want in its pool (their running trials and those waiting, within each
experiment's ``max_slots``), submits worker jobs up to that (and ``max_jobs``), cancels
jobs still pending in Slurm that are no longer wanted, and retires a worker that has run no
step for ``idle_after_s`` when fewer are wanted than run: adaptive, from zero when idle.
A job Slurm ended (``scancel``, a time limit, a lost node) is forgotten once ``squeue`` no
longer lists it, and another is submitted if its slot is still wanted; its trial resumes
from its last checkpoint, as after any lost worker.

Each job runs one worker as the stack's workers run (``cluster.worker_spec``), with the
stack's client variables exported, and asks for Slurm's warning signal before its time
limit (``--signal``): its trial then checkpoints where it stands and resumes on another
job (``cluster.slurm_warning``).
The scheduler reads its settings from ``DET_TASKS_SLURM_WORKERS`` (JSON,
``SlurmWorkerSettings``) when it preloads this module (``--preload cluster.slurm_workers``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from distributed import Scheduler, SchedulerPlugin

from cluster.job_queue import JOB_QUEUE_NAME
from cluster.slurm_settings import (
    JOB_NAME_PREFIX,
    SETTINGS_ENV,
    SLURM_WORKERS_NAME,
    SlurmWorkerSettings,
)

__all__ = [
    "SETTINGS_ENV",
    "SLURM_WORKERS_NAME",
    "SlurmWorkerSettings",
    "SlurmWorkers",
    "check_slurm",
    "dask_setup",
    "trial_of_step_key",
    "wanted_slots",
]

# Under "distributed": the scheduler's log shows it at Dask's own level (INFO).
logger = logging.getLogger("distributed.det_tasks.slurm_workers")
TICK_S = 2.0
# Slurm's time-limit warning reaches the Nanny, which passes it to its worker (both load it).
_WARNING_PRELOADS = (
    "--preload",
    "cluster.slurm_warning",
    "--preload-nanny",
    "cluster.slurm_warning",
)
CHECK_HANDLER = "det_slurm_check"  # a flow asks it before its first trial (check_slurm)
# A step's Dask key begins ``trial-ID-of-EXPERIMENT8-`` (cluster.steps.step_key_prefix).
_STEP_KEY = re.compile(r"trial-(\d+)-of-([^-]{1,8})-")


def trial_of_step_key(key: object) -> tuple[str, int] | None:
    """(the experiment key's first 8 characters, the trial id) of a trial step's Dask key;
    None for any other key."""
    found = _STEP_KEY.match(key) if isinstance(key, str) else None
    return (found.group(2), int(found.group(1))) if found else None


def wanted_slots(jobs: list[Any], pool: str) -> int:
    """Slots the queue's active (not paused) experiments of ``pool`` want: each one's
    running and waiting trials, times their slots per trial, within its ``max_slots``."""
    return sum(wanted_by_shape(jobs, pool).values())


def shape_of(slurm: dict[str, Any] | None) -> str:
    """One key per distinct ``slurm:`` section: jobs of one shape serve any of them."""
    return json.dumps(slurm or {}, sort_keys=True)


def wanted_by_shape(jobs: list[Any], pool: str) -> Counter[str]:
    """``wanted_slots`` per job shape (``shape_of`` the experiment's ``slurm:``)."""
    wanted: Counter[str] = Counter()
    for job in jobs:
        if job.paused or job.pool != pool:
            continue
        slots = job.need * (len(job.running) + len(job.waiting))
        wanted[shape_of(job.slurm)] += min(slots, job.max_slots) if job.max_slots else slots
    return wanted


def _capped(wanted: Counter[str], cap: int) -> Counter[str]:
    """At most ``cap`` jobs in all, shared out shape by shape in a fixed order."""
    capped: Counter[str] = Counter()
    for shape in sorted(wanted):
        capped[shape] = min(wanted[shape], cap - sum(capped.values()))
    return +capped


class SlurmWorkers(SchedulerPlugin):
    """The scheduler's worker jobs: submitted, cancelled and retired to follow demand."""

    name = SLURM_WORKERS_NAME
    idempotent = True

    def __init__(self, settings: SlurmWorkerSettings) -> None:
        self.settings = settings
        self.jobs: dict[str, tuple[Any, str]] = {}  # job name -> (SLURMJob, shape_of)
        self.idle_since: dict[str, float] = {}  # worker name -> when it last ran nothing
        # (experiment key[:8], trial id) -> the worker (job name) that last ran its step
        self.trial_workers: dict[tuple[str, int], str] = {}
        self.scheduler: Scheduler | None = None
        self._serial = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self, scheduler: Scheduler) -> None:
        """Start adapting; once: a preloaded plugin is started on registration and again
        with the scheduler."""
        self.scheduler = scheduler
        scheduler.handlers[CHECK_HANDLER] = self.check
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        closing = (job.close() for job, _ in self.jobs.values())
        await asyncio.gather(*closing, return_exceptions=True)
        self.jobs.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.adapt()
            except asyncio.CancelledError:
                raise
            except Exception:  # a refused sbatch, a slow squeue: logged, tried again
                logger.exception("adapting the Slurm worker jobs failed; trying again")
            await asyncio.sleep(TICK_S)

    @property
    def elastic_pool(self) -> str:
        """The pool it starts workers for: the job queue lists it with no worker yet."""
        return self.settings.pool

    def wanted(self) -> Counter[str]:
        """Worker jobs wanted per shape, within ``max_jobs``."""
        assert self.scheduler is not None
        queue = self.scheduler.plugins.get(JOB_QUEUE_NAME)
        jobs = list(getattr(queue, "jobs", {}).values())
        return _capped(wanted_by_shape(jobs, self.settings.pool), self.settings.max_jobs)

    def held(self) -> Counter[str]:
        return Counter(shape for _, shape in self.jobs.values())

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Remember the worker each trial's steps run on, for ``det job list``'s Slurm
        job ids (a held trial stays on its worker between steps)."""
        trial = trial_of_step_key(key) if finish == "processing" else None
        if trial is None or self.scheduler is None:
            return
        task = self.scheduler.tasks.get(key)
        if task is not None and task.processing_on is not None:
            self.trial_workers[trial] = str(task.processing_on.name)

    def job_ids(self, experiment_key: str, trials: Iterable[int]) -> list[str]:
        """The Slurm job ids of the worker jobs running ``trials`` of the experiment: the
        jobs Slurm still runs whose worker last ran one of their steps."""
        names = {self.trial_workers.get((experiment_key[:8], trial)) for trial in trials}
        return sorted(
            {str(job.job_id) for name, (job, _) in self.jobs.items() if name in names},
            key=lambda job_id: (len(job_id), job_id),
        )

    async def adapt(self) -> None:
        await self._forget_ended_jobs()
        self.trial_workers = {t: n for t, n in self.trial_workers.items() if n in self.jobs}
        wanted, held = self.wanted(), self.held()
        for shape, count in wanted.items():
            if count > held[shape]:
                logger.info("%d worker job(s) of %s wanted, %d held: submitting", count,
                            shape, held[shape])  # fmt: skip
            for _ in range(count - held[shape]):
                await self._submit(shape)
        for shape, count in held.items():
            if count > wanted[shape]:
                await self._release(shape, count - wanted[shape])

    def job_for(self, shape: str, name: str) -> Any:
        """The dask-jobqueue job of ``shape`` (an experiment's ``slurm:``) named ``name``."""
        from dask_jobqueue.slurm import SLURMJob

        assert self.scheduler is not None
        settings = self.settings.for_experiment(json.loads(shape))
        spec = settings.worker_spec()
        exports = {**settings.env, **spec.cli_env()}
        return SLURMJob(
            scheduler=self.scheduler.address,
            name=name,
            job_name=name,
            queue=settings.partition,
            cores=settings.cores,
            memory=settings.memory,
            processes=1,
            walltime=settings.walltime,
            # exec: the worker replaces the job's shell, so Slurm's signals reach it.
            python=f"exec {shlex.quote(settings.python)}",
            local_directory=settings.local_directory,
            job_extra_directives=settings.directives(),
            worker_extra_args=[*spec.cli_args(), *_WARNING_PRELOADS],
            job_script_prologue=[f"export {k}={shlex.quote(v)}" for k, v in exports.items()],
        )

    async def check(self, slurm: dict[str, Any] | None = None) -> dict[str, str]:
        """What Slurm says of a worker job for an experiment's ``slurm:`` (``sbatch
        --test-only``, nothing submitted): ``{"error": ...}`` when it refuses one (an
        unknown partition, an impossible ``--gres``, ``sbatch_args`` it rejects)."""
        job = self.job_for(shape_of(slurm), f"{JOB_NAME_PREFIX}-check")
        with job.job_file() as script:
            proc = await asyncio.create_subprocess_exec(
                "sbatch", "--test-only", script,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await proc.communicate()
        if proc.returncode == 0:
            return {}
        said = " ".join(err.decode(errors="replace").split())
        return {"error": f"Slurm refuses its worker job: {said}"}

    async def _submit(self, shape: str) -> None:
        self._serial += 1
        name = f"{JOB_NAME_PREFIX}-{os.getpid()}-{self._serial}"
        job = self.job_for(shape, name)
        await job.start()
        self.jobs[name] = (job, shape)
        logger.info("Slurm worker job %s submitted for %s", job.job_id, name)

    async def _release(self, shape: str, count: int) -> None:
        """Cancel ``count`` jobs of ``shape``: first those Slurm has not started a worker
        for, then workers idle for ``idle_after_s``."""
        assert self.scheduler is not None
        now = time.monotonic()
        joined = {str(ws.name): ws for ws in self.scheduler.workers.values()}
        for name, ws in joined.items():
            if ws.processing:
                self.idle_since.pop(name, None)
            else:
                self.idle_since.setdefault(name, now)
        mine = [name for name, (_, s) in self.jobs.items() if s == shape]
        pending = [name for name in mine if name not in joined]
        idle = [
            name for name in mine
            if name in joined and now - self.idle_since.get(name, now) >= self.settings.idle_after_s
        ]  # fmt: skip
        for name in (pending + idle)[:count]:
            if name in joined:
                await self.scheduler.retire_workers(workers=[joined[name].address])
            job, _ = self.jobs.pop(name)
            await job.close()
            self.idle_since.pop(name, None)
            logger.info("Slurm worker job for %s released: no longer wanted", name)

    async def _forget_ended_jobs(self) -> None:
        """Drop jobs Slurm no longer lists (cancelled, timed out, node lost)."""
        if not self.jobs:
            return
        ids = ",".join(str(job.job_id) for job, _ in self.jobs.values())
        proc = await asyncio.create_subprocess_exec(
            "squeue", "--noheader", "--format=%i", f"--jobs={ids}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        if proc.returncode != 0 and b"Invalid job id" not in err:
            logger.warning("squeue failed: %s", err.decode(errors="replace").strip())
            return
        listed = set(out.decode().split())
        for name, (job, _) in list(self.jobs.items()):
            if str(job.job_id) not in listed:
                logger.info("Slurm worker job %s (%s) has ended", job.job_id, name)
                del self.jobs[name]


async def dask_setup(scheduler: Scheduler) -> None:
    """``--preload cluster.slurm_workers``: the plugin, with the scheduler's settings."""
    text = os.environ.get(SETTINGS_ENV)
    if not text:
        raise RuntimeError(f"{SETTINGS_ENV} is not set: the Slurm worker jobs' settings")
    await scheduler.register_scheduler_plugin(
        SlurmWorkers(SlurmWorkerSettings.from_json(text)), name=SLURM_WORKERS_NAME, idempotent=True
    )


def check_slurm(client: Any, slurm: dict[str, Any] | None) -> tuple[bool, str | None]:
    """Whether the client's scheduler starts workers as Slurm jobs, and if so Slurm's
    refusal of an experiment's worker jobs (None: accepted)."""
    if not client.run_on_scheduler(_has_slurm_workers):
        return False, None
    answer = client.sync(getattr(client.scheduler, CHECK_HANDLER), slurm=slurm)
    return True, answer.get("error")


def _has_slurm_workers(dask_scheduler: Scheduler) -> bool:
    return SLURM_WORKERS_NAME in dask_scheduler.plugins
