"""Worker recycling in the background, so one worker's restart does not stall the others.

A worker that has built its share of trials (``DET_TASKS_WORKER_MAX_TRIALS``) is restarted
through its Dask Nanny between steps. A restart takes seconds (the new process imports
torch, the harness and the MLflow client again); made on the flow's main loop it held up
every other trial's next step as well, which doubled a 256-trial experiment's cost per
trial once recycling began. Here the restart runs on a thread of its own while the
placement gives the retiring worker nothing; the other workers' trials go on meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from distributed import Client, Scheduler

from cluster.placement import Placement
from cluster.worker_calls import holds_a_trial

__all__ = ["RECYCLE_TIMEOUT_S", "Recycler", "recycle"]

_logger = logging.getLogger(__name__)


class Recycler:
    """Restarts due workers one at a time, off the flow's main loop."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="det-tasks-recycle")
        self._restarts: dict[str, Future[bool]] = {}

    def start(self, worker: str) -> None:
        """Take ``worker`` out of placement and restart it in the background."""
        if worker in self._restarts:
            return
        self.placement.retiring.add(worker)
        self._restarts[worker] = self._pool.submit(recycle, self.placement.client, worker)

    @property
    def busy(self) -> bool:
        return bool(self._restarts)

    def pending(self) -> list[Future[bool]]:
        """The restarts still under way (to wait on beside the trials' steps)."""
        return list(self._restarts.values())

    def reap(self) -> None:
        """Forget the finished restarts: their old addresses are gone from the cluster and
        the restarted processes registered under new ones."""
        for worker, restart in list(self._restarts.items()):
            if restart.done():
                del self._restarts[worker]
                self.placement.retiring.discard(worker)
                if restart.exception() is not None:
                    _logger.warning("recycling worker %s failed: %s", worker, restart.exception())

    def close(self, wait: bool = True) -> None:
        """Wait for the restarts under way (``wait``), or drop those not yet begun."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.reap()


RECYCLE_TIMEOUT_S = 120.0


def recycle(client: Client, worker: str, timeout_s: float = RECYCLE_TIMEOUT_S) -> bool:
    """Restart ``worker``'s process through its Nanny (between steps: it holds no trial and
    nothing is placed on it); True once its replacement (the same name, a new address) has
    registered, False where it cannot be restarted (no Nanny) or did not come back.

    Dask's own wait after a restart counts workers rather than names: while a restarted
    worker's old entry lingers, or another restart is under way, the count is off and that
    wait ran out its whole timeout (120 s of an experiment standing still); so the restart
    is asked for without it, and the replacement is looked for by name here."""
    name = client.scheduler_info(n_workers=-1)["workers"].get(worker, {}).get("name")
    scheduler = client.scheduler
    if scheduler is None:  # a closed client
        return False
    if not _set_aside_if_free(client, worker):
        return False  # another experiment's step or trial is on it now: not this time
    try:
        outcome = client.sync(
            scheduler.restart_workers,
            workers=[worker],
            timeout=timeout_s,
            wait_for_workers=False,
            on_error="return",
            stimulus_id=f"det-tasks-recycle-{time.time()}",
        )
    except Exception as err:  # a worker started without a Nanny cannot be restarted
        _logger.warning("could not recycle Dask worker %s: %s", worker, err)
        _put_back(client, worker)
        return False
    if outcome.get(worker) != "OK":
        _logger.warning("could not recycle Dask worker %s: %s", worker, outcome.get(worker))
        _put_back(client, worker)
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        if any(a != worker and w.get("name") == name for a, w in workers.items()):
            return True
        time.sleep(0.1)
    _logger.warning(
        "recycled Dask worker %s (%s) did not come back in %.0f s", worker, name, timeout_s
    )
    return False


def _set_aside_if_free(client: Client, worker: str) -> bool:
    """Pause ``worker`` on the scheduler (it is given no new step) if it runs no step and
    holds no trial; True if it was. On a shared cluster another experiment may have placed
    a step or a trial on it since this flow saw it free: a restart would kill that."""

    def pause_if_idle(dask_scheduler: Scheduler, worker: str) -> bool:
        ws = dask_scheduler.workers.get(worker)
        if ws is None or ws.processing:
            return False
        dask_scheduler.handle_worker_status_change("paused", worker, f"det-tasks-{time.time()}")
        return True

    try:
        if not client.run_on_scheduler(pause_if_idle, worker=worker):
            return False
        held = client.run(holds_a_trial, workers=[worker]).get(worker)
    except Exception:  # gone meanwhile
        return False
    if held is False:
        return True
    _put_back(client, worker)
    return False


def _put_back(client: Client, worker: str) -> None:
    """Undo ``_set_aside_if_free``: the worker takes steps again."""

    def resume(dask_scheduler: Scheduler, worker: str) -> None:
        dask_scheduler.handle_worker_status_change("running", worker, f"det-tasks-{time.time()}")

    with contextlib.suppress(Exception):
        client.run_on_scheduler(resume, worker=worker)
