"""Running a trial's steps on the cluster: every step is submitted here.

``submit_step`` runs one position-addressed step (``cluster.held_trials.run_step``) on a
worker, the least busy of those ``cluster.placement`` chose, and watches it: a step no
worker can run fails loudly within a minute, one Dask cancels on its own is resubmitted,
and a worker that died under it is explained (``cluster.worker_deaths``). ``release_step``
ends a held trial; the cluster-wide calls stop, release or kill trials on every worker.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future, KilledWorker, Scheduler, default_client, wait

from cluster.held_trials import StepRequest, StepResult, exit_soon, run_step
from cluster.reconnect import SCHEDULER_AWAY_S, plugins_stale, reinstall_after_reconnect
from cluster.stop_requests import stop_requested
from cluster.worker_calls import preempt_trial, release_all, request_stop
from cluster.worker_deaths import explain_death

__all__ = [
    "StepFuture",
    "StepAbandoned",
    "StepStranded",
    "release_on",
    "run_step_explained",
    "wait_for_releases",
    "kill_worker_process",
    "preempt_on",
    "release_everywhere",
    "step_key_prefix",
    "stop_everywhere",
    "submit_step",
    "trials_running",
    "workers_running",
]

_logger = logging.getLogger(__name__)

# How often a waiting step looks at its task's state in the scheduler, and how long it may
# sit where no worker can run it before the experiment fails, naming it.
WATCH_INTERVAL_S = 5.0
STRANDED_AFTER_S = 60.0
# A step Dask cancels on its own (a dropped scheduler connection) is run again this often.
MAX_CANCELLED_RESUBMITS = 3


class StepStranded(RuntimeError):
    """A step that no worker of the cluster can run (the watchdog's loud failure)."""


class StepAbandoned(RuntimeError):
    """The flow closed its Dask client while a step was still being waited on (the flow is
    ending: another trial failed, or it was stopped); nothing more can be learnt of it."""


# A closing client's stopped event loop would hang any call made through it.
_CLIENT_GONE = ("closing", "closed")


def submit_step(
    request: StepRequest, workers: Sequence[str] | None = None, gpus: int = 0
) -> StepResult:
    """Run ``request`` on a worker of the default client's cluster (the least busy of
    ``workers`` preferred) and wait for its result; a lost worker surfaces as
    distributed.KilledWorker.

    The wait is watched: Dask leaves a step pinned (loosely) to a worker that is gone in
    its ``no-worker`` state even when other workers are idle (its scheduler's
    bulk_schedule_unrunnable_after_adding_worker ignores loose restrictions), so such a
    step is resubmitted unpinned; a step that no worker can take for STRANDED_AFTER_S fails
    with StepStranded instead of hanging the experiment (a cluster with no worker at all is
    given SCHEDULER_AWAY_S to get them back). A step cancelled because the scheduler was
    lost is run again once the client has reconnected and the plugins are back."""
    client = _client_with_plugins()
    future = _submit(client, request, workers, gpus)
    done = _done_event(future)
    stranding = _Stranding()
    cancelled = 0
    try:
        while True:
            # Waited on an event, not Future.result(timeout=...): under a heavy load the
            # latter's timeout can race the result inside distributed.utils.sync, which then
            # raised UnboundLocalError ('result') out of a step that was still running.
            finished = done.wait(WATCH_INTERVAL_S)
            if client.status in _CLIENT_GONE:
                raise _abandoned(request)
            if finished:
                if future.status != "cancelled" or cancelled >= MAX_CANCELLED_RESUBMITS:
                    result: StepResult = future.result()
                    return result
                # Cancelled by Dask, not by us (e.g. the client's connection to the
                # scheduler dropped and was re-made): run it again on any worker.
                cancelled += 1
                future = _resubmit_cancelled(client, future, request, gpus)
                done = _done_event(future)
                continue
            try:
                state, restrictions, on_cluster = _task_state(client, future.key)
            except OSError:  # the scheduler is away: its reconnection cancels the step
                if client.status in _CLIENT_GONE:
                    raise _abandoned(request) from None
                continue
            if state != "no-worker":
                stranding.clear()
                continue
            if restrictions:  # pinned to a worker that is gone: any worker may restore it
                future.cancel()
                future.release()
                future = _submit(client, request, None, gpus)
                done = _done_event(future)
                continue
            if stranding.overdue(on_cluster):
                future.cancel()
                raise _stranded(client, request, gpus)
    finally:
        # Released at once: a result kept alive (a timed-out wait's traceback holds a
        # future until the next garbage collection) is "lost" when its worker is recycled,
        # and Dask would recompute the step outside the flow, rebuilding a finished trial.
        future.release()


def _client_with_plugins() -> Client:
    """The default client, with the plugins installed again first if it reconnected since
    it installed them (``plugins_stale``: its scheduler was lost while no step was in
    flight, so no cancelled step installed them)."""
    client = default_client()
    if plugins_stale(client):
        reinstall_after_reconnect(client, _address(client))
    return client


class _Stranding:
    """How long a step has waited in ``no-worker``: STRANDED_AFTER_S is allowed while the
    cluster has workers (none of them can run it: a missing resource or pool),
    SCHEDULER_AWAY_S while it has none at all (they are coming back: a restarted
    scheduler's, under their supervisor). The clock starts again when either turns into
    the other, so workers back after a long absence do not find their step overdue."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.workerless = False

    def clear(self) -> None:
        self.since = None

    def overdue(self, workers: int) -> bool:
        now = time.monotonic()
        if self.since is None or self.workerless != (workers == 0):
            self.since, self.workerless = now, workers == 0
        limit = SCHEDULER_AWAY_S if self.workerless else STRANDED_AFTER_S
        return now - self.since >= limit


def _resubmit_cancelled(client: Client, future: Any, request: StepRequest, gpus: int) -> Any:
    """Run a step Dask cancelled on its own again, on any worker. Its scheduler may have
    restarted: it and its workers then lack the plugins the step needs, installed again
    first (waiting for the reconnection, up to a limit)."""
    _logger.warning(
        "step %s of trial %s was cancelled by Dask (%s); resubmitting it",
        request.kind,
        request.trial.trial_id,
        _cancel_reason(future),
    )
    future.release()
    reinstall_after_reconnect(client, _address(client))
    return _submit(client, request, None, gpus)


def _cancel_reason(future: Any) -> str:
    """Why Dask cancelled ``future``, as it recorded it, read without a call through the
    client's event loop (which may be stopping)."""
    state = getattr(future, "_state", None)
    reason = getattr(state, "exception", None)
    return str(reason) if reason is not None else "no reason given"


def _batches(request: StepRequest) -> str:
    if request.stop is None:  # to the searcher's length, decided on the worker
        return f"from batch {request.start}"
    return f"batches {request.start}..{request.stop}"


def _abandoned(request: StepRequest) -> StepAbandoned:
    return StepAbandoned(
        f"step {request.kind} of trial {request.trial.trial_id} ({_batches(request)}) "
        "was still running when the flow closed its Dask "
        "client: the flow is ending, and its trials' runs end with it"
    )


def _stranded(client: Client, request: StepRequest, gpus: int) -> StepStranded:
    workers = len(client.scheduler_info(n_workers=-1)["workers"])
    wanted = _resources(request, gpus) or {}
    need = " with " + ", ".join(f"{k}={v:g}" for k, v in wanted.items()) if wanted else ""
    return StepStranded(
        f"step {request.kind} of trial {request.trial.trial_id} ({_batches(request)}) "
        f"found no worker{need} to run it for "
        f"{STRANDED_AFTER_S:.0f} s; the cluster has {workers} worker(s)"
    )


def run_step_explained(
    request: StepRequest, workers: Sequence[str] | None = None, gpus: int = 0
) -> StepResult:
    """``submit_step``, where a worker that died under the step becomes a ``StepFailed``
    saying how (exit code, likely cause: cluster.worker_deaths); not retryable once the
    experiment is stopping (its trial was killed on purpose, or dies with the rest)."""
    try:
        return submit_step(request, workers, gpus)
    except KilledWorker as err:
        client = default_client()
        failure = explain_death(client, err, request)
        if stop_requested(client, request.trial.experiment_run_key or "") is not None:
            failure.retryable = False
        raise failure from None


StepFuture = Future  # what release_on returns (a distributed.Future)


def release_on(worker: str, request: StepRequest) -> StepFuture:
    """Submit a held trial's ``release`` step to the worker that holds it (fire and forget;
    any worker may run it if that one is gone: there is then nothing to release)."""
    return default_client().submit(
        run_step, request, pure=False, workers=[worker], allow_other_workers=True
    )


def wait_for_releases(releases: list[StepFuture], timeout_s: float) -> None:
    """Wait until the release steps are done (raises TimeoutError after ``timeout_s``)."""
    wait(releases, timeout=timeout_s)


def _done_event(future: Any) -> threading.Event:
    """Set once ``future`` finished, erred or was cancelled (Dask calls back in a thread)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def _submit(client: Client, request: StepRequest, workers: Sequence[str] | None, gpus: int) -> Any:
    return client.submit(
        run_step,
        request,
        key=f"{step_key_prefix(request.trial.experiment_run_key, request.trial.trial_id)}"
        f"{request.kind}-{request.stop}-{uuid.uuid4().hex[:8]}",
        pure=False,
        workers=list(workers) if workers else None,
        allow_other_workers=bool(workers),  # Dask refuses it without workers=
        resources=_resources(request, gpus),
    )


def _resources(request: StepRequest, gpus: int) -> dict[str, float] | None:
    """What the step's worker must have: the trial's GPUs, and its resource pool where the
    cluster's workers name pools (cluster.job_queue)."""
    wanted: dict[str, float] = {}
    if gpus:
        wanted["GPU"] = gpus
    if request.pool_resource:
        wanted[request.pool_resource] = 1
    return wanted or None


def step_key_prefix(experiment_key: str | None, trial_id: int) -> str:
    """How every Dask key of the trial's steps begins: trial ids repeat between the
    experiments that share a cluster, so the experiment is in it too."""
    return f"trial-{trial_id}-of-{(experiment_key or 'local')[:8]}-"


def workers_running(client: Client, experiment_key: str | None, trial_id: int) -> list[str]:
    """The workers running a step of the trial now (the scheduler's view)."""
    return trials_running(client, experiment_key, [trial_id]).get(trial_id, [])


def trials_running(
    client: Client, experiment_key: str | None, trial_ids: Sequence[int]
) -> dict[int, list[str]]:
    """The workers running a step of each trial now (the scheduler's view; a step waiting
    for a worker's thread counts as running there). A trial running none is left out: its
    step may not be submitted yet."""
    prefixes = {step_key_prefix(experiment_key, t): t for t in trial_ids}

    def look(dask_scheduler: Scheduler, prefixes: dict[str, int]) -> dict[int, list[str]]:
        running: dict[int, list[str]] = {}
        for key, ts in dask_scheduler.tasks.items():
            if ts.processing_on is None:
                continue
            trial = next((t for p, t in prefixes.items() if str(key).startswith(p)), None)
            if trial is not None:
                running.setdefault(trial, []).append(ts.processing_on.address)
        return {trial: sorted(workers) for trial, workers in running.items()}

    if not prefixes:
        return {}
    return dict(client.run_on_scheduler(look, prefixes=prefixes))


def _task_state(client: Client, key: str) -> tuple[str | None, list[str], int]:
    """The scheduler's state of task ``key``, its worker restrictions, and how many workers
    the cluster has."""

    def look(dask_scheduler: Scheduler, key: str) -> tuple[str | None, list[str], int]:
        ts = dask_scheduler.tasks.get(key)
        workers = len(dask_scheduler.workers)
        if ts is None:
            return None, [], workers
        return ts.state, sorted(ts.worker_restrictions or ()), workers

    state, restrictions, workers = client.run_on_scheduler(look, key=key)
    return state, list(restrictions), int(workers)


def _address(client: Client) -> str:
    return str(getattr(client.scheduler, "address", None) or "the flow's scheduler")


def stop_everywhere(client: Client, experiment_key: str, mode: str) -> int:
    """Ask every worker holding one of the experiment's trials to stop it at its next batch
    boundary; the number of trials asked."""
    return sum(bool(v) for v in client.run(request_stop, experiment_key, mode).values())


def preempt_on(client: Client, workers: list[str], experiment_key: str, trial_id: int) -> bool:
    """Ask the workers running the trial to stop it at its next batch boundary, so that
    more urgent work gets its slot (cluster.job_queue); True if one of them holds it."""
    try:
        answers = client.run(
            preempt_trial, experiment_key, trial_id, workers=workers, on_error="return"
        )
    except Exception as err:  # a worker leaving: asked again at the next decision
        _logger.warning("could not ask %s to preempt trial %d: %s", workers, trial_id, err)
        return False
    return any(answer is True for answer in answers.values())


def kill_worker_process(client: Client, worker: str) -> bool:
    """Kill ``worker``'s process, and the processes its trial started (DataLoader workers,
    subprocesses), at once: for a trial stuck in user code that a stop request cannot
    reach. Its Nanny starts a fresh worker; the step it ran fails (KilledWorker). True if the
    worker was asked."""
    try:
        answers = client.run(exit_soon, workers=[worker], on_error="return")
    except Exception as err:  # gone already, or the scheduler is unreachable
        _logger.warning("could not kill Dask worker %s: %s", worker, err)
        return False
    return answers.get(worker) is True


def release_everywhere(
    client: Client, experiment_key: str | None = None, stopped_as: str | None = None
) -> int:
    """End the held trials (closing their MLflow runs) on every worker: all, or only
    ``experiment_key``'s; ``stopped_as`` ends their runs KILLED with that state."""
    counts = client.run(release_all, experiment_key, stopped_as)
    return sum(int(n) for n in counts.values())
