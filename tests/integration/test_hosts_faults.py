"""Faults across real hosts (infra/hosts.py, the session's cluster of a services host and
two worker hosts): a link cut for a minute mid-trial and restored. Needs root and `ip` (CI
runs as root): skipped elsewhere, saying so.

The cut host keeps its trial in memory and trains on, cut off from the scheduler, MLflow
and S3; the scheduler gives its step to the other host, which resumes from the last
checkpoint. When the link comes back, nothing the cut host did meanwhile may count: no
metric step twice in MLflow, no checkpoint registered twice, nothing left RUNNING, and the
experiment ends bit-equal to an undisturbed run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from infra import hosts as hosts_lib
from infra import netns
from tests.integration.hosts_helpers import (
    assert_bit_equal_and_recorded_once,
    busy_hosts,
    finished_flow,
    killed_on_error,
    needs_hosts,
    start_flow,
    wait_for_checkpoints,
)

pytestmark = needs_hosts

CUT_S = 60  # what the issue asks: a minute, past Dask's 30 s TCP timeout


@pytest.mark.slow
def test_a_link_cut_for_a_minute_mid_trial_counts_nothing_twice(
    cluster: hosts_lib.Hosts, hosts_reference: dict[str, Any], tmp_path: Path
) -> None:
    name = "hosts-cut"
    flow = start_flow(cluster, tmp_path / "client", name, "hyperparameters.sleep_s=0.1")
    with killed_on_error(flow):
        wait_for_checkpoints(cluster, flow, name)
        busy = busy_hosts(cluster)
        assert len(busy) == 1, busy
        (victim,) = busy
        (survivor,) = set(cluster.workers) - {victim}
        cluster.cut(victim)
        t0 = time.monotonic()
        moved_s = None
        while time.monotonic() - t0 < CUT_S:
            if moved_s is None and busy_hosts(cluster) - {victim}:
                moved_s = time.monotonic() - t0
            time.sleep(0.5)
        old_worker = _worker_processes(cluster.config.network.namespace(victim))
        cluster.cut(victim, connected=True)
    summary, _ = finished_flow(flow)
    print(f"host {victim} cut for {CUT_S} s; its trial moved after {moved_s} s")
    assert moved_s is not None, "the trial did not move off the cut host within the cut"
    # Back on the network, the cut host learns it lost its scheduler and closes its worker
    # (Dask's rule), ending the trial it still held: whatever that trial did in the dark
    # reaches MLflow and S3 now, or never. Its supervisor then starts a fresh worker, which
    # holds nothing. Checked once nothing of the old worker runs any more.
    deadline = time.monotonic() + 240
    while old_worker & set(netns.namespace_pids(cluster.config.network.namespace(victim))):
        assert time.monotonic() < deadline, "the cut host's worker never ended"
        time.sleep(1)
    print(f"the cut host's processes ended {time.monotonic() - t0 - CUT_S:.1f} s after the link")
    trial = assert_bit_equal_and_recorded_once(cluster, name, summary, hosts_reference)
    assert trial.data.tags["det.holder"].startswith(cluster.hostname(survivor) + " "), (
        trial.data.tags
    )


def _worker_processes(namespace: str) -> set[int]:
    """The processes of a host's Dask worker now: every process in its namespace but its
    supervisor (infra.supervise, which outlives the worker to start it again) and the
    wrappers it runs under."""
    lasting: set[int] = set()
    pids = set(netns.namespace_pids(namespace))
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if "infra.supervise" in " ".join(proc.cmdline()):
                lasting |= {pid, *(parent.pid for parent in proc.parents())}
        except psutil.Error:  # gone meanwhile
            continue
    return pids - lasting
