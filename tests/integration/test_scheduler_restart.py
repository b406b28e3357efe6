"""The Dask scheduler SIGKILLed under a running experiment on real hosts (the session's
cluster: services on host 0, a worker on each of hosts 1 and 2), and started again 10 s
later with ``infra.hosts.heal`` (what ``python -m infra.hosts heal`` runs).

Found before (2 of 2): every worker closed and stayed down; the running trial's MLflow run
was closed FINISHED / COMPLETED at its current batch; once workers were brought back by
hand every retry failed ("has no 'det-tasks-held-trial' plugin") and the experiment ended
ERROR for good.

Now: the workers come back by themselves (infra.supervise), the flow reconnects and
installs its plugins again (cluster.reconnect), the trial resumes from its newest
checkpoint and the experiment ends bit-equal to an undisturbed run, with every training
step and checkpoint recorded once and the trial never recorded COMPLETED before its
120th batch.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from infra import dask_cluster
from infra import hosts as hosts_lib
from tests.integration.hosts_helpers import (
    assert_bit_equal_and_recorded_once,
    finished_flow,
    killed_on_error,
    needs_hosts,
    start_flow,
    trial_run,
    wait_for_checkpoints,
)

pytestmark = [needs_hosts, pytest.mark.slow]

SCHEDULER_DOWN_S = 10


class _StateWatch:
    """Every (status, det.state, steps trained) the trial run shows while the flow runs."""

    def __init__(self, mlflow: Any, name: str) -> None:
        self.mlflow, self.name = mlflow, name
        self.seen: list[tuple[str, str | None, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.3):
            try:
                run = trial_run(self.mlflow, self.name)
                if run is None:
                    continue
                trained = run.data.metrics.get("progress/batches", -1)
                self.seen.append((run.info.status, run.data.tags.get("det.state"), int(trained)))
            except Exception:  # MLflow busy: the next look
                continue

    def stop(self) -> list[tuple[str, str | None, int]]:
        self.done.set()
        self.thread.join(timeout=10)
        return self.seen


def test_a_scheduler_restart_costs_at_most_the_work_since_the_checkpoint(
    cluster: hosts_lib.Hosts, hosts_reference: dict[str, Any], tmp_path: Path
) -> None:
    from registry.runs.tracking import client_for

    name = "hosts-scheduler-restart"
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    flow = start_flow(cluster, tmp_path / "client", name, "hyperparameters.sleep_s=0.25")
    scheduler = dask_cluster.scheduler_service(
        cluster.config.stack.root, cluster.config.stack.dask_port, cluster.config.stack.host
    )
    watch = _StateWatch(mlflow, name)
    with killed_on_error(flow):
        try:
            wait_for_checkpoints(cluster, flow, name)
            os.killpg(int(scheduler.pidfile.read_text().strip()), signal.SIGKILL)
            killed_at = time.monotonic()
            time.sleep(SCHEDULER_DOWN_S)
        finally:
            hosts_lib.heal(cluster.config)  # the scheduler back, whatever happened
        back_at = time.monotonic()
        assert flow.poll() is None, "the experiment ended while the scheduler was away"
        summary, err = finished_flow(flow)
    seen = watch.stop()
    print(f"scheduler away {back_at - killed_at:.1f} s; flow log tail:\n{err[-1500:]}")
    early = [s for s in seen if s[1] == "COMPLETED" and s[2] < 120]
    assert not early, f"recorded COMPLETED short of 120 batches: {early}"
    assert_bit_equal_and_recorded_once(cluster, name, summary, hosts_reference)
    # Both hosts' workers are back under their supervisor, not only the one that trained.
    registered = dask_cluster.registered_workers(cluster.config.scheduler)
    assert {cluster.hostname(h) for h in cluster.workers} <= registered
