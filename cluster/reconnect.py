"""What the flow's Dask client needs on the cluster, and getting it back after the
scheduler restarts under a running experiment.

A restarted scheduler knows nothing of what the flows registered (the held-trial and
death-record plugins, the job queue), and its workers, started again by their supervisor
(``infra.supervise``), have none of it. The client reconnects on its own (distributed
retries for the client's ``timeout``); the first step that finds its future cancelled by
the lost connection calls ``reinstall_after_reconnect`` before it is run again, so every
worker has the plugins before any step reaches it; a step submitted over a newer connection
than the one the plugins were installed over (``plugins_stale``: the scheduler was lost
while no step was in flight) does the same first. A scheduler away longer than
SCHEDULER_AWAY_S ends the experiment with a line that says so; it can be continued.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from distributed import Client, Scheduler

from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin
from cluster.job_slots import register_job_queue
from cluster.worker_deaths import DEATHS_PLUGIN_NAME, DeathRecorder

__all__ = [
    "SCHEDULER_AWAY_S",
    "SchedulerLost",
    "outliving_scheduler_restarts",
    "plugins_stale",
    "register_plugins",
    "reinstall_after_reconnect",
]

_logger = logging.getLogger(__name__)

# How long a flow waits for its scheduler to come back (a restart, its host brought back).
SCHEDULER_AWAY_S = 600.0
# distributed's Client sends to its scheduler in batches at most every 10 ms (a fixed
# BatchedSend interval): a step submitted within 10 ms of the previous step's release, as a
# trial's validate and checkpoint are, waited out the rest. bench/dask_round_trip.py: a
# step's submit-to-result 6.2 ms at 10 ms, 4.6 ms at 1 ms (median of 3, 2-core VM).
CLIENT_SEND_INTERVAL_S = 0.001

# One re-installation at a time in this process: two trials' steps cancelled together
# would otherwise both find the plugin missing and register it twice, and a second
# registration replaces the first on every worker (tearing down what it holds).
_REINSTALLING = threading.Lock()


# Set on a client by register_plugins and reinstall_after_reconnect: the scheduler connection
# over which the plugins were installed or found (a reconnected client has a new one).
_INSTALLED_OVER = "_det_tasks_plugins_installed_over"


class SchedulerLost(RuntimeError):
    """The flow's scheduler did not come back within SCHEDULER_AWAY_S."""


def register_plugins(client: Client) -> None:
    """Install what the flows need on the cluster's workers, Nannies and scheduler: once
    per cluster (every plugin is idempotent), never replacing what other experiments' trials
    use (the scheduler's job queue included)."""
    send_promptly(client)
    client.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
    client.register_plugin(DeathRecorder(), name=DEATHS_PLUGIN_NAME)
    try:
        register_job_queue(client)
    except Exception as err:  # a scheduler without this package: the flow says it does without
        _logger.debug("job queue: not installed on the scheduler (%s)", err)
    setattr(client, _INSTALLED_OVER, client.scheduler_comm)


def plugins_stale(client: Client) -> bool:
    """Whether ``client`` installed the plugins over an earlier connection than its current
    one: its scheduler may have restarted since, with none of them, and its workers too.
    A reconnection cancels the steps in flight, and the first of them installs the plugins
    again; but a scheduler lost while no step was in flight (the flow between a trial's
    train and validate, held up by MLflow being away) cancelled none, and the next steps
    waited on their workers for a plugin nobody installed (a CI run's test_chaos: the
    experiment ended ERROR). False for a client that never installed them."""
    installed_over = getattr(client, _INSTALLED_OVER, None)
    return installed_over is not None and installed_over is not client.scheduler_comm


def send_promptly(client: Client) -> None:
    """Shorten ``client``'s batching interval to CLIENT_SEND_INTERVAL_S (a reconnected
    client gets distributed's default again)."""
    comm = getattr(client, "scheduler_comm", None)
    if comm is not None and hasattr(comm, "interval"):
        comm.interval = CLIENT_SEND_INTERVAL_S


@contextlib.contextmanager
def outliving_scheduler_restarts(client: Client) -> Iterator[Client]:
    """Let ``client`` reconnect for SCHEDULER_AWAY_S after losing its scheduler, for the
    block. distributed retries for the client's connect timeout (30 s by default), which is
    also how long a first connection may take; a restart of the scheduler's host takes
    longer, while a wrong address should still fail within those 30 s. So the retry window
    is set once connected (distributed keeps it on the client as ``_timeout``), and put
    back after the block: a client's close waits up to twice that value."""
    before = getattr(client, "_timeout", None)
    if before is not None:
        client._timeout = SCHEDULER_AWAY_S
    try:
        yield client
    finally:
        if before is not None:
            client._timeout = before


def reinstall_after_reconnect(client: Client, address: str) -> None:
    """Wait until ``client`` is connected to its scheduler again, then register the plugins
    if that scheduler lacks them (it restarted). Raises SchedulerLost if the client gave up."""
    deadline = time.monotonic() + SCHEDULER_AWAY_S + 5
    while client.status != "running":
        if client.status in ("closing", "closed") or time.monotonic() > deadline:
            raise SchedulerLost(
                f"the Dask scheduler at {address} was away for more than "
                f"{SCHEDULER_AWAY_S:.0f} s: start it again (python -m infra.stack up), then "
                "continue the experiment from its newest checkpoint (det experiment continue "
                "ID, or the --activate line the flow printed)"
            )
        time.sleep(0.2)
    with _REINSTALLING:
        if not client.run_on_scheduler(_has_held_trials):
            _logger.warning(
                "the Dask scheduler at %s restarted: installing the platform's plugins again",
                address,
            )
            register_plugins(client)
        else:
            send_promptly(client)
            setattr(client, _INSTALLED_OVER, client.scheduler_comm)


def _has_held_trials(dask_scheduler: Scheduler) -> bool:
    return PLUGIN_NAME in dask_scheduler.worker_plugins
