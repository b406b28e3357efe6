"""Starting the Dask cluster a flow runs its steps on, or connecting to one.

``dask_client(n)`` connects to the scheduler named by ``DET_TASKS_DASK_SCHEDULER``
(``tcp://host:8786``: one experiment then uses every worker of that cluster, on any number of
hosts), or starts an embedded ``LocalCluster`` of ``n`` worker processes for this flow run,
each training on its share of the cores (``det_tasks.cpu_threads``). On a host with GPUs the
embedded cluster has one worker per ``slots`` GPUs, each seeing only its own
(``CUDA_VISIBLE_DEVICES``) and advertising them as the Dask resource ``GPU``; steps then ask
for ``GPU=slots``, so Dask, not lock files, keeps two trials off one GPU. Either way the
client registers the worker plugins (held trials, death records) before any step runs.
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
from collections.abc import Iterator
from typing import Any

import dask
import psutil
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster
from distributed.utils import get_mp_context

from cluster import warm_forkserver
from cluster.devices import gpu_count, gpu_groups
from cluster.environment import EXPECTED_WORKERS_ENV, SCHEDULER_ENV, accepts
from cluster.reconnect import (
    CLIENT_SEND_INTERVAL_S,
    outliving_scheduler_restarts,
    register_plugins,
    send_promptly,
)
from cluster.worker_spec import NANNY_SETTINGS, QUIET_DIAGNOSTICS, WorkerSpec
from det_tasks.cpu_threads import worker_share
from det_tasks.errors import ConfigError

__all__ = [
    "CLIENT_SEND_INTERVAL_S",
    "SCHEDULER_ENV",
    "background_cluster",
    "dask_client",
    "embedded_cluster",
    "hold_free_port",
    "send_promptly",
    "worker_memory_mb",
    "workers_that_fit",
]


@contextlib.contextmanager
def dask_client(n_workers: int = 2, gpu_slots: int = 1) -> Iterator[Client]:
    """A Dask client (also the process's default client) with the held-trial plugin
    registered on every worker, present and future; an embedded cluster is closed after."""
    address = os.environ.get(SCHEDULER_ENV)
    if address:
        _raise_if_it_failed_to_start(address)
        with (
            Client(address, set_as_default=True) as client,
            outliving_scheduler_restarts(client),  # a stack's scheduler may restart under it
        ):
            _wait_for_workers(client, int(os.environ.get(EXPECTED_WORKERS_ENV, "1")))
            register_plugins(client)
            yield client
        return
    n_workers = workers_that_fit(n_workers)
    with embedded_cluster(n_workers, gpu_slots) as cluster, Client(cluster) as client:
        _wait_for_workers(client, n_workers)
        register_plugins(client)
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
    if n <= 0:  # workers started on demand (cluster.slurm_workers): the queue asks for them
        return
    try:
        client.wait_for_workers(n, timeout=timeout_s)
    except TimeoutError:
        address = client.scheduler_info().get("address")
        raise RuntimeError(
            f"fewer than {n} Dask worker(s) joined the scheduler {address} "
            f"within {timeout_s:.0f} s: start workers with `dask worker ADDRESS --nthreads 1` "
            f"(or unset {SCHEDULER_ENV} to run an embedded cluster)"
        ) from None


def _warm_forkserver() -> None:
    """Workers fork from a warm server (see cluster.warm_forkserver)."""
    warm_forkserver.configure(get_mp_context())  # after Dask has set its own list


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
    ``cluster.worker_spec.NO_MEMORY_LIMIT``), so this is the guard: more workers than RAM
    would have the operating system kill some mid-trial. Trials beyond the workers wait for
    one, as Dask queues them. GPU hosts are bounded by their GPUs instead."""
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
        # Dask's dashboard diagnostics, slowed or off (cluster.worker_spec): nobody opens
        # this cluster's dashboard (a random port).
        **QUIET_DIAGNOSTICS,
        # Non-daemonic workers (cluster.worker_spec): each Nanny reads it as it starts.
        **NANNY_SETTINGS,
    }
    with dask.config.set(settings):
        _warm_forkserver()
        gpus = gpu_count()
        if gpus:
            groups = gpu_groups(gpus, gpu_slots, max(1, n_workers))
            threads = worker_share(len(groups))
            workers = {
                f"gpu-{'-'.join(map(str, group))}": {
                    "cls": Nanny,
                    "options": WorkerSpec(threads, gpus=tuple(group)).nanny_options(),
                }
                for group in groups
            }
            scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "port": port}}
            with SpecCluster(workers=workers, scheduler=scheduler) as cluster:
                yield cluster
            return
        # The host's cores shared out between the workers (Dask's Nanny gives each one
        # thread, which left a lone trial on half of a 2-core host).
        options = WorkerSpec(threads=worker_share(max(1, n_workers))).nanny_options()
        with LocalCluster(
            n_workers=max(1, n_workers),
            threads_per_worker=options.pop("nthreads"),
            processes=True,
            dashboard_address=":0",
            scheduler_port=port,
            # Shutdown races (a worker's last heartbeat to a closed scheduler) are not the
            # user's business; a failing step still raises in the flow, naming its error.
            silence_logs=logging.CRITICAL,
            **options,
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
