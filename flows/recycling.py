"""Worker recycling in the background, so one worker's restart does not stall the others.

A worker that has built its share of trials (``DET_TASKS_WORKER_MAX_TRIALS``) is restarted
through its Dask Nanny between steps. A restart takes seconds (the new process imports
torch, the harness and the MLflow client again); made on the flow's main loop it held up
every other trial's next step as well, which doubled a 256-trial experiment's cost per
trial once recycling began. Here the restart runs on a thread of its own while the
placement gives the retiring worker nothing; the other workers' trials go on meanwhile.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from flows.engine import Placement, recycle

__all__ = ["Recycler"]

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
