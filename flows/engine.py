"""The engine behind experiments: a Dask cluster of warm worker processes.

- ``dask_client(n)`` connects to the scheduler named by ``DET_TASKS_DASK_SCHEDULER``
  (``tcp://host:8786``: one experiment then uses every worker of that cluster, on any number
  of hosts), or starts an embedded ``LocalCluster`` of ``n`` worker processes for this
  flow run, each training on its share of the cores (``det_tasks.cpu_threads``). On a
  host with GPUs the embedded cluster has one worker per ``slots`` GPUs, each seeing only
  its own (``CUDA_VISIBLE_DEVICES``) and advertising them as the Dask resource ``GPU``;
  steps then ask for ``GPU=slots``, so Dask, not lock files, keeps two trials off one GPU.
- ``submit_step`` runs one position-addressed step (``flows.workers.run_step``) on a
  worker; ``Placement`` keeps a trial's steps on the worker that holds it in memory (Dask
  worker restrictions, loose: if that worker is gone Dask runs the step elsewhere and the
  step restores the trial from its checkpoint).

Dask does the scheduling, transport, worker lifecycles and failure detection; this module
only chooses which worker a trial prefers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dask
import psutil
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster, default_client
from distributed.utils import get_mp_context

from det_tasks.cpu_threads import WORKER_THREADS_ENV, worker_share
from det_tasks.errors import ConfigError
from flows import warm_forkserver
from flows.devices import gpu_count, gpu_groups
from flows.embedded import accepts
from flows.worker_deaths import DEATHS_PLUGIN_NAME, DeathRecorder
from flows.workers import (
    PLUGIN_NAME,
    HeldTrialPlugin,
    StepRequest,
    StepResult,
    exit_soon,
    holds_foreign_trial,
    release_all,
    request_stop,
    run_step,
)

__all__ = [
    "SCHEDULER_ENV",
    "Placement",
    "StepStranded",
    "background_cluster",
    "dask_client",
    "embedded_cluster",
    "hold_free_port",
    "kill_worker_process",
    "release_everywhere",
    "CLIENT_SEND_INTERVAL_S",
    "send_promptly",
    "stop_everywhere",
    "step_key_prefix",
    "submit_step",
    "worker_memory_mb",
    "workers_running",
    "workers_that_fit",
]

SCHEDULER_ENV = "DET_TASKS_DASK_SCHEDULER"
EXPECTED_WORKERS_ENV = "DET_TASKS_DASK_WAIT_WORKERS"  # set by background_cluster


@contextlib.contextmanager
def dask_client(n_workers: int = 2, gpu_slots: int = 1) -> Iterator[Client]:
    """A Dask client (also the process's default client) with the held-trial plugin
    registered on every worker, present and future; an embedded cluster is closed after."""
    address = os.environ.get(SCHEDULER_ENV)
    if address:
        _raise_if_it_failed_to_start(address)
        with Client(address, set_as_default=True) as client:
            _wait_for_workers(client, int(os.environ.get(EXPECTED_WORKERS_ENV, "1")))
            _register(client)
            yield client
        return
    n_workers = workers_that_fit(n_workers)
    with embedded_cluster(n_workers, gpu_slots) as cluster, Client(cluster) as client:
        _wait_for_workers(client, n_workers)
        _register(client)
        yield client


@dataclasses.dataclass
class _Starting:
    """An embedded cluster that ``background_cluster`` is starting in a thread."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


_STARTING: dict[str, _Starting] = {}  # scheduler address -> its start, while in the block


def _raise_if_it_failed_to_start(address: str, timeout_s: float = 300.0) -> None:
    """Wait until this process's embedded cluster at ``address`` (if it is one) has its
    scheduler listening, or has failed to start: then raise at once, naming the cause. The
    client would otherwise be refused for 30 s and report only the address."""
    starting = _STARTING.get(address)
    if starting is None:
        return
    deadline = time.monotonic() + timeout_s
    while not starting.done.wait(0.02):
        if accepts(address) or time.monotonic() > deadline:
            return  # connect while the workers still start, as before
    if starting.error is not None:
        raise RuntimeError(
            f"the embedded Dask cluster at {address} failed to start: "
            f"{type(starting.error).__name__}: {starting.error}; run the command again, or "
            f"point {SCHEDULER_ENV} at a running scheduler (`dask scheduler`)"
        ) from starting.error


def _wait_for_workers(client: Client, n: int, timeout_s: float = 300.0) -> None:
    try:
        client.wait_for_workers(n, timeout=timeout_s)
    except TimeoutError:
        address = client.scheduler_info().get("address")
        raise RuntimeError(
            f"fewer than {n} Dask worker(s) joined the scheduler {address} "
            f"within {timeout_s:.0f} s: start workers with `dask worker ADDRESS --nthreads 1` "
            f"(or unset {SCHEDULER_ENV} to run an embedded cluster)"
        ) from None


def _register(client: Client) -> None:
    """Install what the flows need on the cluster's workers and Nannies: once per cluster
    (both plugins are idempotent), never replacing what other experiments' trials use."""
    send_promptly(client)
    client.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
    client.register_plugin(DeathRecorder(), name=DEATHS_PLUGIN_NAME)


# distributed's Client sends to its scheduler in batches at most every 10 ms (a fixed
# BatchedSend interval): a step submitted within 10 ms of the previous step's release, as a
# trial's validate and checkpoint are, waited out the rest. bench/dask_round_trip.py: a
# step's submit-to-result 6.2 ms at 10 ms, 4.6 ms at 1 ms (median of 3, 2-core VM).
CLIENT_SEND_INTERVAL_S = 0.001


def send_promptly(client: Client) -> None:
    """Shorten ``client``'s batching interval to CLIENT_SEND_INTERVAL_S (a reconnected
    client gets distributed's default again)."""
    comm = getattr(client, "scheduler_comm", None)
    if comm is not None and hasattr(comm, "interval"):
        comm.interval = CLIENT_SEND_INTERVAL_S


def _warm_forkserver() -> None:
    """Workers fork from a warm server (see flows.warm_forkserver)."""
    warm_forkserver.configure(get_mp_context())  # after Dask has set its own list


# Dask's default memory limit is the host's RAM / workers, and a worker past 80% of it is
# *paused*: it silently stops running tasks. Our workers hold trials (torch, a model, data
# loaders) in process memory, not Dask data, so 32 workers on 23 GB (0.79 GB each, 0.68 GB
# used) all paused and the experiment hung. Instead, workers_that_fit starts no more embedded
# workers than the host's available memory holds.
NO_MEMORY_LIMIT = 0


WORKER_MEMORY_ENV = "DET_TASKS_WORKER_MEMORY_MB"
# A warm CPU worker holding the MNIST example measured 0.40-0.45 GB (torch, the clients, the
# trial); user models are bigger, so a user with one sets the variable.
DEFAULT_WORKER_MEMORY_MB = 512
_logger = logging.getLogger(__name__)


def worker_memory_mb() -> int:
    """``DET_TASKS_WORKER_MEMORY_MB``: the memory one embedded trial worker is counted at."""
    raw = os.environ.get(WORKER_MEMORY_ENV, str(DEFAULT_WORKER_MEMORY_MB))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(
            f"{WORKER_MEMORY_ENV}={raw!r}: expected a positive whole number of megabytes "
            f"(the memory one trial worker needs; default {DEFAULT_WORKER_MEMORY_MB})"
        )
    return value


def workers_that_fit(n_workers: int) -> int:
    """How many of ``n_workers`` embedded CPU trial workers this host's available memory
    holds (``DET_TASKS_WORKER_MEMORY_MB`` each). Dask's own memory limit is off (see
    NO_MEMORY_LIMIT), so this is the guard: more workers than RAM would have the operating
    system kill some mid-trial. Trials beyond the workers wait for one, as Dask queues them.
    GPU hosts are bounded by their GPUs instead."""
    wanted = max(1, n_workers)
    if gpu_count():
        return wanted
    per_worker_mb = worker_memory_mb()
    available_mb = psutil.virtual_memory().available // 2**20
    fit = max(1, available_mb // per_worker_mb)
    if fit >= wanted:
        return wanted
    _logger.warning(
        "%d trial workers at %d MB each would need %d MB; this host has %d MB available, so "
        "%d of them start and the other trials wait for a free one (lower "
        "searcher.max_concurrent_trials, or set %s to what one of your trials needs)",
        wanted,
        per_worker_mb,
        wanted * per_worker_mb,
        available_mb,
        fit,
        WORKER_MEMORY_ENV,
    )
    return fit


@contextlib.contextmanager
def embedded_cluster(n_workers: int, gpu_slots: int = 1, port: int = 0) -> Iterator[Any]:
    """A cluster of ``n_workers`` worker processes on this host (one step at a time each), its
    scheduler on ``port`` (0: any free port); see the module docstring for GPU hosts."""
    logging.getLogger("distributed").setLevel(logging.WARNING)
    # When a flow stops early, each nanny logs that it had to kill its busy worker: one
    # line per worker (32 in a 32-trial experiment) that buried the error that stopped it.
    logging.getLogger("distributed.nanny").setLevel(logging.ERROR)
    settings = {
        # A lost worker fails its step at once (KilledWorker), so the flow's retry policy
        # (max_restarts) decides, rather than Dask silently re-running it elsewhere.
        "distributed.scheduler.allowed-failures": 0,
        # Steps are long and placed on purpose (where their trial is held); stealing one
        # for an idle worker would only force a restore.
        "distributed.scheduler.work-stealing": False,
        "distributed.worker.multiprocessing-method": "forkserver",
        # Trials start processes of their own (DataLoader workers, subprocesses), which a
        # daemonic worker may not; the Nanny reads this when it starts each worker.
        "distributed.worker.daemon": False,
    }
    with dask.config.set(settings):
        _warm_forkserver()
        gpus = gpu_count()
        if gpus:
            groups = gpu_groups(gpus, gpu_slots, max(1, n_workers))
            workers = {
                f"gpu-{'-'.join(map(str, group))}": {
                    "cls": Nanny,
                    "options": {
                        "nthreads": 1,
                        "memory_limit": NO_MEMORY_LIMIT,
                        "env": {
                            "CUDA_VISIBLE_DEVICES": ",".join(map(str, group)),
                            WORKER_THREADS_ENV: str(worker_share(len(groups))),
                        },
                        "resources": {"GPU": len(group)},
                    },
                }
                for group in groups
            }
            scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "port": port}}
            with SpecCluster(workers=workers, scheduler=scheduler) as cluster:
                yield cluster
            return
        with LocalCluster(
            n_workers=max(1, n_workers),
            threads_per_worker=1,
            processes=True,
            memory_limit=NO_MEMORY_LIMIT,
            dashboard_address=":0",
            scheduler_port=port,
            # Shutdown races (a worker's last heartbeat to a closed scheduler) are not the
            # user's business; a failing step still raises in the flow, naming its error.
            silence_logs=logging.CRITICAL,
            # The host's cores shared out between the workers (Dask's Nanny gives each one
            # thread, which left a lone trial on half of a 2-core host).
            env={WORKER_THREADS_ENV: str(worker_share(max(1, n_workers)))},
        ) as cluster:
            yield cluster


def hold_free_port() -> tuple[int, socket.socket | None]:
    """A free local port, and a socket that keeps it from everyone else until its server
    binds it (Linux; None elsewhere). Why: a port probed and let go can be handed to another
    socket (an outgoing connection's local end) before the scheduler, started in a thread a
    second later, binds it; the scheduler then failed with EADDRINUSE. On Linux two
    SO_REUSEADDR sockets may share a port while neither listens, and a bound port is never
    picked for ``bind(0)`` or a connection's local end: the holder, bound and never
    listening, keeps the port, and Dask's listener (tornado, SO_REUSEADDR) still binds and
    listens on it. macOS and Windows refuse that sharing, so there the port is let go at
    once, as before. Close the holder once the server is up."""
    probe = socket.socket()
    if sys.platform.startswith("linux"):
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1], probe
    with probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1], None


@contextlib.contextmanager
def background_cluster(n_workers: int, gpu_slots: int = 1) -> Iterator[str]:
    """Start an embedded cluster in a thread, so its workers come up while the caller does
    other start-up work (the no-server mode: Prefect's ephemeral server); yields its address
    at once and points ``DET_TASKS_DASK_SCHEDULER`` at it for the block (clients wait for
    the scheduler to come up)."""
    n_workers = workers_that_fit(n_workers)
    port, holder = hold_free_port()
    address = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()
    starting = _STARTING[address] = _Starting()

    def let_go() -> None:
        if holder is not None:
            holder.close()

    def hold() -> None:
        try:
            with embedded_cluster(n_workers, gpu_slots, port):
                let_go()  # the scheduler listens on the port now
                starting.done.set()
                stop.wait()
        except BaseException as err:
            if starting.done.is_set():  # it was up: stopping it failed
                logging.getLogger(__name__).exception("the embedded Dask cluster failed")
            else:
                starting.error = err  # dask_client raises it, naming the cause
        finally:
            let_go()
            starting.done.set()

    before = {name: os.environ.get(name) for name in (SCHEDULER_ENV, EXPECTED_WORKERS_ENV)}
    thread = threading.Thread(target=hold, name="det-tasks-dask-cluster", daemon=True)
    try:
        thread.start()
        os.environ[SCHEDULER_ENV] = address
        os.environ[EXPECTED_WORKERS_ENV] = str(max(1, n_workers))
        yield address
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=60)
        let_go()
        if _STARTING.get(address) is starting:
            del _STARTING[address]
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# How often a waiting step looks at its task's state in the scheduler, and how long it may
# sit where no worker can run it before the experiment fails, naming it.
WATCH_INTERVAL_S = 5.0
STRANDED_AFTER_S = 60.0
# A step Dask cancels on its own (a dropped scheduler connection) is run again this often.
MAX_CANCELLED_RESUBMITS = 3


class StepStranded(RuntimeError):
    """A step that no worker of the cluster can run (the watchdog's loud failure)."""


def submit_step(request: StepRequest, worker: str | None = None, gpus: int = 0) -> StepResult:
    """Run ``request`` on a worker of the default client's cluster (``worker`` preferred)
    and wait for its result; a lost worker surfaces as distributed.KilledWorker.

    The wait is watched: Dask leaves a step pinned (loosely) to a worker that is gone in
    its ``no-worker`` state even when other workers are idle (its scheduler's
    bulk_schedule_unrunnable_after_adding_worker ignores loose restrictions), so such a
    step is resubmitted unpinned; a step that no worker can take for STRANDED_AFTER_S fails
    with StepStranded instead of hanging the experiment."""
    client = default_client()
    future = _submit(client, request, worker, gpus)
    done = _done_event(future)
    stranded_since: float | None = None
    cancelled = 0
    try:
        while True:
            # Waited on an event, not Future.result(timeout=...): under a heavy load the
            # latter's timeout can race the result inside distributed.utils.sync, which then
            # raised UnboundLocalError ('result') out of a step that was still running.
            if done.wait(WATCH_INTERVAL_S):
                if future.status != "cancelled" or cancelled >= MAX_CANCELLED_RESUBMITS:
                    result: StepResult = future.result()
                    return result
                # Cancelled by Dask, not by us (e.g. the client's connection to the
                # scheduler dropped and was re-made): run it again on any worker.
                cancelled += 1
                _logger.warning(
                    "step %s of trial %s was cancelled by Dask (%s); resubmitting it",
                    request.kind,
                    request.trial.trial_id,
                    future.exception(),
                )
                future.release()
                future = _submit(client, request, None, gpus)
                done = _done_event(future)
                continue
            state, restrictions = _task_state(client, future.key)
            if state != "no-worker":
                stranded_since = None
                continue
            if restrictions:  # pinned to a worker that is gone: any worker may restore it
                future.cancel()
                future.release()
                future = _submit(client, request, None, gpus)
                done = _done_event(future)
                continue
            now = time.monotonic()
            stranded_since = stranded_since or now
            if now - stranded_since >= STRANDED_AFTER_S:
                future.cancel()
                workers = len(client.scheduler_info(n_workers=-1)["workers"])
                need = f" with GPU={gpus}" if gpus else ""
                raise StepStranded(
                    f"step {request.kind} of trial {request.trial.trial_id} (batches "
                    f"{request.start}..{request.stop}) found no worker{need} to run it for "
                    f"{STRANDED_AFTER_S:.0f} s; the cluster has {workers} worker(s)"
                )
    finally:
        # Released at once: a result kept alive (a timed-out wait's traceback holds a
        # future until the next garbage collection) is "lost" when its worker is recycled,
        # and Dask would recompute the step outside the flow, rebuilding a finished trial.
        future.release()


def _done_event(future: Any) -> threading.Event:
    """Set once ``future`` finished, erred or was cancelled (Dask calls back in a thread)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def _submit(client: Client, request: StepRequest, worker: str | None, gpus: int) -> Any:
    return client.submit(
        run_step,
        request,
        key=f"{step_key_prefix(request.trial.experiment_run_key, request.trial.trial_id)}"
        f"{request.kind}-{request.stop}-{uuid.uuid4().hex[:8]}",
        pure=False,
        workers=[worker] if worker else None,
        allow_other_workers=bool(worker),  # Dask refuses it without workers=
        resources={"GPU": gpus} if gpus else None,
    )


def step_key_prefix(experiment_key: str | None, trial_id: int) -> str:
    """How every Dask key of the trial's steps begins: trial ids repeat between the
    experiments that share a cluster, so the experiment is in it too."""
    return f"trial-{trial_id}-of-{(experiment_key or 'local')[:8]}-"


def workers_running(client: Client, experiment_key: str | None, trial_id: int) -> list[str]:
    """The workers running a step of the trial now (the scheduler's view)."""
    prefix = step_key_prefix(experiment_key, trial_id)

    def look(dask_scheduler: Scheduler, prefix: str) -> list[str]:
        return sorted(
            ts.processing_on.address
            for key, ts in dask_scheduler.tasks.items()
            if isinstance(key, str) and key.startswith(prefix) and ts.processing_on is not None
        )

    return list(client.run_on_scheduler(look, prefix=prefix))


def _task_state(client: Client, key: str) -> tuple[str | None, list[str]]:
    """The scheduler's state of task ``key`` and its worker restrictions."""

    def look(dask_scheduler: Scheduler, key: str) -> tuple[str | None, list[str]]:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            return None, []
        return ts.state, sorted(ts.worker_restrictions or ())

    state, restrictions = client.run_on_scheduler(look, key=key)
    return state, list(restrictions)


def stop_everywhere(client: Client, experiment_key: str, mode: str) -> int:
    """Ask every worker holding one of the experiment's trials to stop it at its next batch
    boundary; the number of trials asked."""
    return sum(bool(v) for v in client.run(request_stop, experiment_key, mode).values())


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


class Placement:
    """Which worker each trial prefers: the one that holds it, while no other running
    trial has claimed that worker; a trial starting a segment otherwise gets a worker no
    running trial has claimed (Dask picks when every worker is claimed)."""

    def __init__(self, client: Client, experiment_key: str | None = None) -> None:
        self.client = client
        self.experiment_key = experiment_key
        self.home: dict[int, str] = {}
        self.claimed: dict[str, int] = {}
        # Workers being recycled (flows.recycling): given nothing until they are back.
        self.retiring: set[str] = set()
        info = client.scheduler_info(n_workers=-1)
        self.gpus = any(w.get("resources", {}).get("GPU") for w in info["workers"].values())

    def workers(self) -> list[str]:
        """The cluster's workers that can take a step now."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        return [w for w in workers if w not in self.retiring]

    def claim(self, trial_id: int) -> str | None:
        """A worker for the trial's next segment (None: let Dask choose)."""
        workers = self.workers()
        home = self.home.get(trial_id)
        if home in workers and home not in self.claimed:
            choice: str | None = home
        else:
            homes = set(self.home.values())
            taken = self._held_by_other_experiments()
            free = [w for w in workers if w not in self.claimed and w not in taken]
            # Prefer a worker that holds no trial at all, then any unclaimed one.
            free.sort(key=lambda w: w in homes)
            choice = free[0] if free else None
        if choice is not None:
            self.claimed[choice] = trial_id
        return choice

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

    def done(self, trial_id: int) -> None:
        """The trial's segment ended: its worker may take another trial."""
        self.claimed = {w: t for w, t in self.claimed.items() if t != trial_id}
