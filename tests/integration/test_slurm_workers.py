"""Dask workers as Slurm jobs (cluster/slurm_workers.py) on a real Slurm site
(infra/slurm.py): the stack on host 0 with no worker of its own, a ``slurmd`` on each
compute host. An experiment's trial gets a worker job started on demand, trains on a
compute node bit-equal to an undisturbed run, and the job is given back once idle."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.slurm_workers import SlurmWorkerSettings
from infra import hosts as hosts_lib
from infra import netns, slurm, stack
from tests.integration.helpers import isolated_stack_config
from tests.integration.hosts_helpers import (
    assert_bit_equal_and_recorded_once,
    finished_flow,
    killed_on_error,
    prefix,
    start_flow,
    undisturbed_reference,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        slurm.missing_requirements() is not None, reason=str(slurm.missing_requirements())
    ),
]

_OFFSET = int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0"))


@pytest.fixture(scope="module")
def slurm_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[hosts_lib.Hosts, slurm.SlurmSite]]:
    root = tmp_path_factory.mktemp("slurm-cluster")
    network = netns.Network(hosts=2, subnet=f"10.81.{_OFFSET // 10 % 250}", prefix=prefix("w"))
    site = slurm.SlurmSite(
        root / "site", network, ctld_port=26821 + _OFFSET, slurmd_port=26822 + _OFFSET,
        hidden=(str(root / "stack"),),
    )  # fmt: skip
    settings = SlurmWorkerSettings(
        partition=site.partition, memory="3GB", slurm_conf=str(site.conf),
        output_dir=str(site.scratch),
    )  # fmt: skip
    config = dataclasses.replace(
        isolated_stack_config(root / "stack", 60),
        host=network.gateway, dask_workers=0, slurm_workers=settings.to_json(),
    )  # fmt: skip
    with slurm.running(site):
        try:
            env = stack.up(config)
            yield hosts_lib.Hosts(hosts_lib.HostsConfig(root, network, config), env), site
        finally:
            stack.down(config)


def _jobs(site: slurm.SlurmSite) -> list[str]:
    done = subprocess.run(
        ["squeue", "--noheader", "--format=%i %j %T %N"], capture_output=True, text=True,
        timeout=30, env={**os.environ, **slurm.client_env(site)}, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if line.strip()]


def _running(flow: subprocess.Popen[str]) -> bool:
    if flow.poll() is not None:
        _, err = flow.communicate()
        raise AssertionError(f"the flow ended {flow.returncode}: {err[-3000:]}")
    return True


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def test_a_trial_gets_a_worker_job_on_demand_trains_bit_equal_and_the_job_goes_when_idle(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    cluster, site = slurm_cluster
    assert _jobs(site) == []  # from zero: no experiment, no worker job
    want = undisturbed_reference(tmp_path / "reference")
    flow = start_flow(cluster, tmp_path / "home", "slurm-xor")
    with killed_on_error(flow):
        jobs = _wait("worker job", 120, lambda: _running(flow) and _jobs(site))
    assert len(jobs) == 1 and "det-worker" in jobs[0], jobs  # one trial, one worker job
    summary, err = finished_flow(flow, timeout_s=600)
    assert_bit_equal_and_recorded_once(cluster, "slurm-xor", summary, want)
    assert any(f"on host {node}" in err for node in site.nodes), err[-3000:]
    # Idle for the default minute once the experiment ended: given back to Slurm.
    _wait("release of the idle worker job", 180, lambda: _jobs(site) == [])
