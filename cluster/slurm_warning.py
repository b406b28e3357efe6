"""Slurm's warning before a worker job's time limit: the trial it holds checkpoints where it
stands and gives its slot back, as it does for more urgent work, then the worker closes.

A worker job (cluster.slurm_workers) asks Slurm for SIGUSR1 ``warning_s`` seconds before
its time limit (``--signal=B:USR1@N``). The job's shell ``exec``s the Nanny, so the signal
reaches the Nanny, which passes it to its worker process (``--preload-nanny`` of this
module). There (``--preload`` of this module) the held trial is preempted as by the job
queue: its train step stops at the next batch boundary, the flow checkpoints it on this
worker and queues it again. The worker restores no trial from then on (a step for one goes
back to the scheduler); once it holds none it closes, the job ends, and the trial resumes
from that checkpoint on another job, which the plugin submits because the slot is still
wanted. Without this (a signal ignored, a trial in a ``det-tasks run``
segment), the time limit ends the worker and the trial resumes from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from distributed import Nanny, Worker

__all__ = ["WARNING_SIGNAL", "dask_setup"]

logger = logging.getLogger("distributed.det_tasks.slurm_warning")
WARNING_SIGNAL = signal.SIGUSR1
CLOSE_WITHIN_S = 600.0  # a trial that never releases: the time limit ends it anyway
_CLOSING: list[asyncio.Future[None]] = []  # kept until done (the loop holds tasks weakly)


async def dask_setup(server: Nanny | Worker) -> None:
    """Preloaded in the Nanny (pass the signal on) and in its worker (act on it)."""
    loop = asyncio.get_running_loop()
    if isinstance(server, Nanny):
        loop.add_signal_handler(WARNING_SIGNAL, _pass_to_worker, server)
    else:
        loop.add_signal_handler(WARNING_SIGNAL, _leave, server)


def _pass_to_worker(nanny: Nanny) -> None:
    pid = nanny.pid
    logger.info("Slurm's time-limit warning: passed to the worker process %s", pid)
    if pid:
        os.kill(pid, WARNING_SIGNAL)


def _leave(worker: Worker) -> None:
    """Preempt the held trial (a checkpoint where it stands), then close once it is
    released."""
    from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin

    plugin: Any = worker.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, HeldTrialPlugin):
        plugin.leaving = True  # a step for a trial it does not hold goes elsewhere
    held = plugin.held if isinstance(plugin, HeldTrialPlugin) else None
    if held is not None:
        plugin.preempt(held.spec.experiment_run_key or "", held.spec.trial_id)
        logger.info("Slurm's time-limit warning: trial %s gives way here", held.spec.trial_id)
    _CLOSING.append(asyncio.ensure_future(_close_once_released(worker, plugin)))


async def _close_once_released(worker: Worker, plugin: Any) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLOSE_WITHIN_S
    while loop.time() < deadline:
        # Released, and its steps' results fetched: a worker closing with a result no
        # other worker holds is kept open by the scheduler's retirement.
        held = plugin is not None and plugin.held is not None
        if not (held or worker.state.executing_count or worker.data):
            break
        await asyncio.sleep(0.1)
    logger.info("Slurm's time-limit warning: worker %s closes", worker.name)
    await worker.close_gracefully(reason="slurm-time-limit-warning")
