"""The Dask scheduler SIGKILLed while the flow has no step in flight, and started again.

A restarted scheduler, and the workers its supervisor brings back, have none of the plugins
the flow installed. Steps in flight when the connection drops are cancelled, and the first
of them installs the plugins again (``cluster.reconnect``). With no step in flight, nothing
was cancelled: the next step went to a worker without the held-trial plugin, waited a
minute for it, and failed, and so did each retry (a CI run's test_chaos: the flow had been
held between a trial's train and validate steps by MLflow being away when the scheduler
was killed, and the experiment ended ERROR). A real scheduler and a real supervised worker,
as the stack starts them.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from tests.integration.helpers import FLOW_MODEL, wait_for


def _free_port_pair() -> int:
    """A free port whose next port is free too (the scheduler's and its HTTP server's)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        with socket.socket() as pair:
            try:
                pair.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports side by side")


def test_a_step_after_the_scheduler_restarted_between_steps_finds_its_plugins(
    tmp_path: Path,
) -> None:
    from distributed import Client

    from cluster.held_trials import PLUGIN_NAME, StepRequest
    from cluster.reconnect import outliving_scheduler_restarts, register_plugins
    from cluster.steps import submit_step
    from det_tasks.runner.held import TrialSpec
    from infra import dask_cluster
    from infra.services import start, stop

    port = _free_port_pair()
    scheduler = dask_cluster.scheduler_service(tmp_path, port)
    address = dask_cluster.scheduler_address(port)
    worker = dask_cluster.worker_service(tmp_path, address, "restart-worker")
    spec = TrialSpec(str(FLOW_MODEL / "grid.yaml"), str(FLOW_MODEL), (), 1, {"hidden": 4})
    release = StepRequest(spec, "release", 0, 0, parent_run_id="p", experiment_id="e")
    try:
        start(scheduler)
        start(worker)
        with Client(address, timeout=30) as client, outliving_scheduler_restarts(client):
            register_plugins(client)  # as the flow's cluster.startup.dask_client does
            first = submit_step(release)
            assert first.released is False  # the plugin answered: it holds no trial
            os.killpg(int(scheduler.pidfile.read_text().strip()), signal.SIGKILL)
            wait_for(lambda: client.status != "running", 30, "the client to lose its scheduler")
            start(scheduler)
            wait_for(lambda: client.status == "running", 60, "the client to reconnect")
            wait_for(
                lambda: "restart-worker" in dask_cluster.registered_workers(address),
                120,
                "the supervised worker to rejoin",
            )
            assert PLUGIN_NAME not in client.run_on_scheduler(
                lambda dask_scheduler: list(dask_scheduler.worker_plugins)
            ), "a restarted scheduler has none of the flow's plugins"
            second = submit_step(release)
        assert second.released is False and second.worker != first.worker
    finally:
        stop(worker)
        stop(scheduler)
