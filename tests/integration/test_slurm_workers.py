"""Dask workers as Slurm jobs (cluster/slurm_workers.py) on a real Slurm site
(infra/slurm.py): the stack on host 0 with no worker of its own, a ``slurmd`` on each
compute host. An experiment's trial gets a worker job started on demand, trains on a
compute node bit-equal to an undisturbed run, and the job is given back once idle."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.slurm_workers import SlurmWorkerSettings
from infra import hosts as hosts_lib
from infra import netns, slurm, stack
from tests.integration.helpers import isolated_stack_config, wait_for
from tests.integration.hosts_helpers import (
    assert_bit_equal_and_recorded_once,
    finished_flow,
    killed_on_error,
    prefix,
    start_flow,
    undisturbed_reference,
    wait_for_checkpoints,
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


def test_a_trial_gets_a_worker_job_on_demand_trains_bit_equal_and_the_job_goes_when_idle(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    cluster, site = slurm_cluster
    assert _jobs(site) == []  # from zero: no experiment, no worker job
    want = undisturbed_reference(tmp_path / "reference")
    flow = start_flow(cluster, tmp_path / "home", "slurm-xor")
    with killed_on_error(flow):
        jobs = wait_for(lambda: _running(flow) and _jobs(site), 120, "worker job")
    assert len(jobs) == 1 and "det-worker" in jobs[0], jobs  # one trial, one worker job
    summary, err = finished_flow(flow, timeout_s=600)
    assert_bit_equal_and_recorded_once(cluster, "slurm-xor", summary, want)
    assert any(f"on host {node}" in err for node in site.nodes), err[-3000:]
    # Idle for the default minute once the experiment ended: given back to Slurm.
    wait_for(lambda: _jobs(site) == [], 180, "release of the idle worker job")


def test_scancel_of_the_worker_job_mid_trial_costs_only_the_work_since_its_checkpoint(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    cluster, site = slurm_cluster
    want = undisturbed_reference(tmp_path / "reference")
    flow = start_flow(cluster, tmp_path / "home", "slurm-scancel")
    with killed_on_error(flow):
        wait_for_checkpoints(cluster, flow, "slurm-scancel")
        (first,) = _jobs(site)
        job_id = first.split()[0]
        done = subprocess.run(
            ["scancel", job_id], env={**os.environ, **slurm.client_env(site)}, timeout=30
        )
        assert done.returncode == 0
        # The slot is still wanted: another job is submitted and the trial resumes there.
        wait_for(lambda: _running(flow) and _other_job(site, job_id), 120, "a second worker job")
    summary, _ = finished_flow(flow, timeout_s=600)
    assert_bit_equal_and_recorded_once(cluster, "slurm-scancel", summary, want)


def test_slurms_time_limit_warning_checkpoints_the_trial_where_it_stands_and_it_resumes(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    """Slurm's warning (``--signal=B:USR1@N``), sent here as Slurm sends it, to the job's
    batch step: the trial checkpoints at the batch it reached (not one of its every-30
    checkpoints), the worker job ends, and the trial resumes on a new job bit-equal."""
    from registry.checkpoints import checkpoint_records
    from registry.tracking import client_for

    cluster, site = slurm_cluster
    want = undisturbed_reference(tmp_path / "reference")
    flow = start_flow(cluster, tmp_path / "home", "slurm-warned", "hyperparameters.sleep_s=0.25")
    with killed_on_error(flow):
        trial = wait_for_checkpoints(cluster, flow, "slurm-warned")
        (first,) = _jobs(site)
        job_id = first.split()[0]
        warned = subprocess.run(
            ["scancel", "--batch", "--signal=USR1", job_id],
            env={**os.environ, **slurm.client_env(site)}, timeout=30,
        )  # fmt: skip
        assert warned.returncode == 0
        wait_for(lambda: _running(flow) and _gone(site, job_id), 120, "the warned job's end")
    summary, err = finished_flow(flow, timeout_s=600)
    assert "preempted at batch" in err, err[-3000:]
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    steps = [r["steps_completed"] for r in checkpoint_records(mlflow, trial.info.run_id)]
    where = [s for s in steps if s % 30]
    assert len(where) == 1, steps  # the warning's checkpoint, where the trial stood
    assert_bit_equal_and_recorded_once(
        cluster,
        "slurm-warned",
        summary,
        want,
        sorted({30, 60, 90, 100, 120, *where}),
        tuple(sorted({30, 60, 90, 120, *where})),
    )


def _gone(site: slurm.SlurmSite, job_id: str) -> bool:
    return all(line.split()[0] != job_id for line in _jobs(site))


def _other_job(site: slurm.SlurmSite, gone: str) -> bool:
    return any(line.split()[0] != gone for line in _jobs(site))


@pytest.mark.parametrize(
    ("section", "refusal"),
    [
        ('["--partition=nope"]', "invalid partition"),
        ('["--gres=gpu:a100:1"]', "gres"),
    ],
)
def test_worker_jobs_slurm_refuses_fail_the_experiment_before_anything_is_submitted(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite],
    tmp_path: Path,
    section: str,
    refusal: str,
) -> None:
    cluster, site = slurm_cluster
    before = {line.split()[0] for line in _jobs(site)}  # an earlier test's, still idle
    flow = start_flow(cluster, tmp_path / "home", "slurm-refused", f"slurm.sbatch_args={section}")
    _, err = flow.communicate(timeout=300)
    assert flow.returncode != 0
    line = next(line for line in err.splitlines() if "slurm: Slurm refuses its worker job" in line)
    assert refusal in line.lower(), line
    assert {line.split()[0] for line in _jobs(site)} <= before  # none submitted for it
