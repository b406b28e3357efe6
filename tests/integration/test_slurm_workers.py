"""Dask workers as Slurm jobs (cluster/slurm_workers.py) on a real Slurm site
(infra/slurm.py): the stack on host 0 with no worker of its own, a ``slurmd`` on each
compute host. An experiment's trial gets a worker job started on demand, trains on a
compute node bit-equal to an undisturbed run, and the job is given back once idle."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import hosts as hosts_lib
from infra import netns, slurm, stack
from registry.runs.run_nodes import nodes_of
from registry.runs.tracking import EXPERIMENT_RUN_TAG, client_for
from tests.integration.helpers import FLOW_MODEL, isolated_stack_config, wait_for
from tests.integration.hosts_helpers import (
    FLOW_FROM_PACKAGE,
    assert_bit_equal_and_recorded_once,
    client_env,
    finished_flow,
    killed_on_error,
    prefix,
    start_flow,
    trial_run,
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
    config = slurm.stack_on_site(isolated_stack_config(root / "stack", 60), site)
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
    trial = assert_bit_equal_and_recorded_once(cluster, "slurm-xor", summary, want)
    assert any(f"on host {node}" in err for node in site.nodes), err[-3000:]
    # The node it ran on is kept on its run, and det experiment describe names it.
    (node,) = nodes_of(trial.data.tags)
    assert node in site.nodes and f"on host {node}" in err
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    parent = mlflow.get_run(trial.data.tags["mlflow.parentRunId"])
    row = _describe_row(cluster, tmp_path / "home", parent.data.tags[EXPERIMENT_RUN_TAG][:8])
    assert row[:2] == ["1", "COMPLETED"] and row[-1] == node, row
    # Idle for the default minute once the experiment ended: given back to Slurm.
    wait_for(lambda: _jobs(site) == [], 180, "release of the idle worker job")


def test_an_asha_search_gets_worker_jobs_on_demand_and_gives_them_back_when_idle(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    """asha.yaml, 4 trials, 2 at a time: from no job, a worker job per running trial (2,
    one per node); rungs at 16, 32 and 64 batches stop 4 -> 2 -> 1, each trial on a compute
    node; once the search ends and its workers sit idle, every job is given back."""
    from registry.checkpoints.models import trial_runs

    cluster, site = slurm_cluster
    assert _jobs(site) == []
    flow = subprocess.Popen(
        [sys.executable, "-c", FLOW_FROM_PACKAGE, str(FLOW_MODEL), str(FLOW_MODEL / "asha.yaml"),
         "name=slurm-asha", "searcher.max_trials=4"],
        env=client_env(cluster, tmp_path / "home"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with killed_on_error(flow):
        wait_for(lambda: _running(flow) and len(_jobs(site)) == 2, 180, "two worker jobs")
    finished_flow(flow, timeout_s=600)
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("slurm-asha")
    (parent,) = mlflow.search_runs([experiment.experiment_id], "tags.`det.experiment_run` != ''")
    trained = {}
    for trial in trial_runs(mlflow, parent):
        steps = [m.step for m in mlflow.get_metric_history(trial.info.run_id, "training/loss")]
        trained[trial.data.tags["det.trial_id"]] = max(steps)
        assert set(nodes_of(trial.data.tags)) <= set(site.nodes), trial.data.tags
    assert sorted(trained.values()) == [16, 16, 32, 64]
    wait_for(lambda: _jobs(site) == [], 180, "release of the idle worker jobs")


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
        # det job list names the experiment's worker job, as squeue does.
        assert _det_job_list(cluster, tmp_path / "home")["slurm-scancel"] == job_id
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
    _assert_resumed_from_where_it_stood(cluster, flow, trial, "slurm-warned", want)


def test_a_slurm_preemption_checkpoints_the_trial_where_it_stands_and_it_resumes_bit_equal(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    """A job of the site's urgent partition needs the node of the worker job: Slurm preempts
    it (PreemptMode=REQUEUE, GraceTime), sending the job's own --signal at once
    (preempt_send_user_signal). The trial gives way as to more urgent work, with a
    checkpoint at the batch it reached; the worker closes, so the job ends within its grace
    (Slurm requeues only a job still running then), another is submitted for the slot still
    wanted, and the trial resumes there bit-equal."""

    cluster, site = slurm_cluster
    want = undisturbed_reference(tmp_path / "reference")
    flow = start_flow(cluster, tmp_path / "home", "slurm-preempted", "hyperparameters.sleep_s=0.25")
    slurm_env = {**os.environ, **slurm.client_env(site)}
    with killed_on_error(flow):
        trial = wait_for_checkpoints(cluster, flow, "slurm-preempted")
        (first,) = _jobs(site)
        job_id, node = first.split()[0], first.split()[-1]
        urgent = subprocess.run(
            ["sbatch", "--parsable", f"--partition={site.urgent_partition}", f"--nodelist={node}",
             "--mem=3000", f"--output={site.scratch}/urgent-%j.out", "--wrap=sleep 10"],
            env=slurm_env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert urgent.returncode == 0, urgent.stderr
        wait_for(lambda: _running(flow) and _gone(site, job_id), 120, "the preempted job's end")
    finished = _assert_resumed_from_where_it_stood(cluster, flow, trial, "slurm-preempted", want)
    assert nodes_of(finished.data.tags)[0] == node  # where it started, and was preempted


def test_two_experiments_at_two_priorities_the_urgent_trial_runs_first_on_the_granted_worker(
    slurm_cluster: tuple[hosts_lib.Hosts, slurm.SlurmSite], tmp_path: Path
) -> None:
    """Slurm grants the nodes, the job queue picks the trial: both experiments wait while
    other jobs fill every node (their worker jobs pend), then one node frees. Its one worker
    goes to the priority-1 experiment, created second; the default-priority one trains only
    once it has finished, and still ends bit-equal to an undisturbed run."""
    from cluster.job_requests import list_jobs

    cluster, site = slurm_cluster
    want = undisturbed_reference(tmp_path / "reference")
    scheduler = cluster.env["DET_TASKS_DASK_SCHEDULER"]
    # No worker from an earlier test: given back after the default idle minute.
    wait_for(lambda: _jobs(site) == [], 180, "earlier tests' idle worker jobs given back")
    blockers = [_fill(site, node) for node in site.nodes]
    try:
        low = start_flow(cluster, tmp_path / "low", "slurm-low", "hyperparameters.sleep_s=0.1")
        urgent = start_flow(
            cluster, tmp_path / "urgent", "slurm-urgent", "resources.priority=1",
            "searcher.max_length.batches=30",
        )  # fmt: skip
        with killed_on_error(low), killed_on_error(urgent):
            wait_for(
                lambda: _running(low) and _running(urgent)
                and {j["name"] for j in list_jobs(scheduler) if j["state"] == "QUEUED"}
                >= {"slurm-low", "slurm-urgent"},
                180, "both experiments queued",
            )  # fmt: skip
            # The two fillers, and a worker job for each experiment, pending.
            wait_for(lambda: len(_jobs(site)) == 4, 60, "a worker job for each")
            _cancel(site, blockers[0])  # one node frees: one worker job runs
            urgent_summary, _ = finished_flow(urgent, timeout_s=600)
            low_summary, _ = finished_flow(low, timeout_s=600)
    finally:
        _cancel(site, *blockers)
    assert urgent_summary["summary"]["best"]["batches_trained"] == 30
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    low_run = assert_bit_equal_and_recorded_once(cluster, "slurm-low", low_summary, want)
    urgent_run = trial_run(mlflow, "slurm-urgent")
    # One worker: the urgent trial's report at its last batch (30) came before the other's
    # first report (batch 30 of 120), so it trained first and to its end.
    urgent_reports = mlflow.get_metric_history(urgent_run.info.run_id, "training/loss")
    low_reports = mlflow.get_metric_history(low_run.info.run_id, "training/loss")
    assert [m.step for m in urgent_reports] == [30]
    assert max(m.timestamp for m in urgent_reports) < min(m.timestamp for m in low_reports)


def _assert_resumed_from_where_it_stood(
    cluster: hosts_lib.Hosts, flow: subprocess.Popen[str], trial: Any, name: str, want: dict
) -> Any:
    """The flow ends; its trial gave way once, with exactly one checkpoint off the every-30
    grid (where it stood when signalled), and ended bit-equal to the undisturbed run, each
    metric and checkpoint recorded once. Returns the finished trial run."""
    from registry.checkpoints.store import checkpoint_records

    summary, err = finished_flow(flow, timeout_s=600)
    assert "preempted at batch" in err, err[-3000:]
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    steps = [r["steps_completed"] for r in checkpoint_records(mlflow, trial.info.run_id)]
    where = [s for s in steps if s % 30]
    assert len(where) == 1, steps  # the signal's checkpoint, where the trial stood
    return assert_bit_equal_and_recorded_once(
        cluster,
        name,
        summary,
        want,
        sorted({30, 60, 90, 100, 120, *where}),
        tuple(sorted({30, 60, 90, 120, *where})),
    )


def _fill(site: slurm.SlurmSite, node: str) -> str:
    """A job of someone else's that takes all of ``node``'s memory; its id."""
    done = subprocess.run(
        ["sbatch", "--parsable", f"--nodelist={node}", f"--mem={site.memory_mb_per_node}",
         "--output=/dev/null", "--wrap=sleep 900"],
        env={**os.environ, **slurm.client_env(site)}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _cancel(site: slurm.SlurmSite, *job_ids: str) -> None:
    env = {**os.environ, **slurm.client_env(site)}
    done = subprocess.run(
        ["scancel", *job_ids], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def _describe_row(cluster: hosts_lib.Hosts, home: Path, experiment: str) -> list[str]:
    """Trial 1's row of ``det experiment describe``, as a user on host 0 sees it."""
    described = subprocess.run(
        [str(Path(sys.executable).parent / "det"), "experiment", "describe", experiment],
        env=client_env(cluster, home), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert described.returncode == 0, described.stderr
    return next(line.split() for line in described.stdout.splitlines() if line.startswith("1 "))


def _det_job_list(cluster: hosts_lib.Hosts, home: Path) -> dict[str, str]:
    """``det job list`` as a user on host 0 runs it: each job name's Slurm job ids."""
    listing = subprocess.run(
        [str(Path(sys.executable).parent / "det"), "job", "list"],
        env=client_env(cluster, home), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    header, _, *rows = listing.stdout.splitlines()
    assert header.endswith("slurm jobs"), header
    name, state, ids = (header.index(c) for c in ("job name", "state", "slurm jobs"))
    return {row[name:state].strip(): row[ids:].strip() for row in rows}


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
