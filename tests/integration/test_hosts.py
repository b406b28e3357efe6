"""Real hosts on one machine (infra/hosts.py): network namespaces on a private bridge, the
stack on host 0's bridge address, one Dask worker per other host with its own address,
hostname and private files. Needs root and `ip` (CI runs as root): skipped elsewhere, saying so.

- a host lost mid-trial (every process in its namespace SIGKILLed): the trial continues on
  the other host from its last checkpoint and ends bit-equal to an undisturbed run, with
  no metric step twice in MLflow and nothing left RUNNING; steps name the host they ran on;
- SIGTERM while the cluster starts leaves no namespace, link or process behind, nor does
  ``down`` after a host's processes were started by hand.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra import hosts as hosts_lib
from infra import netns
from tests.integration.helpers import (
    FLOW_MODEL,
    REPO,
    env_without_platform,
    environment,
)
from tests.integration.hosts_helpers import (
    SPARE_SUBNET,
    assert_bit_equal_and_recorded_once,
    busy_hosts,
    finished_flow,
    hosts_config,
    killed_on_error,
    needs_hosts,
    prefix,
    start_flow,
    wait_for_checkpoints,
)

pytestmark = needs_hosts


def _lose_the_host_holding_the_trial(
    cluster: hosts_lib.Hosts, flow: subprocess.Popen[str], name: str
) -> tuple[int, float]:
    """Once the trial has its first checkpoint, SIGKILL every process of the host training
    it; returns that host and the seconds until a step of it ran on another host."""
    wait_for_checkpoints(cluster, flow, name)
    busy = busy_hosts(cluster)
    assert flow.poll() is None and len(busy) == 1, (busy, flow.poll())
    (victim,) = busy
    cluster.lose(victim)
    lost = time.monotonic()
    while not busy_hosts(cluster) - {victim} and flow.poll() is None:
        time.sleep(0.2)
    return victim, time.monotonic() - lost


@pytest.mark.slow
def test_a_host_lost_mid_trial_continues_on_another_host_bit_equal(
    cluster: hosts_lib.Hosts, hosts_reference: dict[str, Any], tmp_path: Path
) -> None:
    from registry.runs.tracking import client_for

    name = "hosts-lost"
    flow = start_flow(cluster, tmp_path / "client", name, "hyperparameters.sleep_s=0.1")
    with killed_on_error(flow):
        victim, to_elsewhere_s = _lose_the_host_holding_the_trial(cluster, flow, name)
    summary, err = finished_flow(flow)
    (survivor,) = set(cluster.workers) - {victim}
    print(f"host {victim} lost; its trial ran on host {survivor} {to_elsewhere_s:.1f} s later")
    trial = assert_bit_equal_and_recorded_once(cluster, name, summary, hosts_reference)

    # The flow's step logs name the worker that ran each step: all on the survivor's
    # address, the first restored from a checkpoint (the victim's steps never ended).
    ran_on = re.findall(r" on tcp://([\d.]+):\d+ \((warm|restored from [^,]+)", err)
    assert ran_on and {ip for ip, _ in ran_on} == {cluster.address(survivor)}, ran_on
    assert ran_on[0][1].startswith("restored from runs:/"), ran_on
    # ... and the host by its own name, the survivor's hostname (not the machine's).
    named = re.findall(r" s\) on host (\S+?)(?::|\s|$)", err)
    assert named and set(named) == {cluster.hostname(survivor)}, named
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    run_key = mlflow.get_run(trial.data.tags["mlflow.parentRunId"]).data.tags["det.experiment_run"]
    _a_step_names_its_host(cluster, trial, run_key, summary["package"])


def _a_step_names_its_host(
    cluster: hosts_lib.Hosts, trial: Any, run_key: str, package: str
) -> None:
    """A step's StepResult names the namespace's hostname, and the worker is on that host:
    validate @120 of the finished trial, restored from its checkpoint through S3 on
    whichever host takes it, gives the run's own final validation again."""
    from distributed import Client

    from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin, StepRequest
    from cluster.steps import submit_step
    from det_tasks.config.entered import enter_file
    from det_tasks.runner.held import TrialSpec

    hparams = {k[3:]: v for k, v in trial.data.params.items() if k.startswith("hp.")}
    overrides = ("name=hosts-lost", "hyperparameters.sleep_s=0")
    spec = TrialSpec(
        config_path="killable.yaml",  # replaced on the worker by the package's paths
        model_dir="model",
        overrides=overrides,
        trial_id=1,
        hparams={k: json.loads(v) for k, v in hparams.items()},
        experiment_run_key=run_key,
        config=enter_file(FLOW_MODEL / "killable.yaml", list(overrides)),  # as a flow sends it
    )
    request = StepRequest(
        trial=spec,
        kind="validate",
        start=120,
        stop=120,
        parent_run_id=trial.data.tags["mlflow.parentRunId"],
        experiment_id=trial.info.experiment_id,
        package=package,
        release_after=True,
    )
    with (
        environment(**cluster.env),
        Client(cluster.env["DET_TASKS_DASK_SCHEDULER"], timeout=30) as client,
    ):
        client.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
        result = submit_step(request)
    host = cluster.host_of(result.worker)
    assert result.host == cluster.hostname(host) == f"{prefix('c')}-host-{host}"
    assert result.restored_from and result.validation is not None
    assert result.validation["validation_loss"] == trial.data.metrics["validation/validation_loss"]


def test_down_removes_every_namespace_link_and_process(tmp_path: Path) -> None:
    """What a crashed `up` would leave (a host's namespace with a process in it): `down`
    finds it all by its prefix and removes it."""
    # Not the session cluster's subnet: two bridges with one address would share its route.
    config = hosts_config(tmp_path, prefix("d"), hosts=2, subnet=SPARE_SUBNET)
    netns.create(config.network)
    try:
        proc = subprocess.Popen(
            netns.host_argv(
                config.network, 1, config.hostname(1), str(tmp_path / "w"), [], ["sleep", "600"]
            )
        )
        deadline = time.monotonic() + 10
        host_1 = config.network.namespace(1)
        while not netns.namespace_pids(host_1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.pid in netns.namespace_pids(host_1)  # `ip netns exec`, then `sleep`
        assert len(netns.leftovers(config.network)) == 5  # 2 namespaces, 2 veths, the bridge
    finally:
        hosts_lib.down(config)
    assert netns.leftovers(config.network) == []
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_killed_clusters_empty_network_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    """What a run killed before its teardown leaves (CI stopped at its time limit: the
    namespaces, empty): the next `up` removes it (netns.remove_abandoned). With a process
    still on one of its hosts, it is someone's cluster, and it stays."""
    config = hosts_config(tmp_path, prefix("k"), hosts=2, subnet=SPARE_SUBNET)
    netns.create(config.network)
    try:
        assert netns.abandoned(config.network)
        proc = subprocess.Popen(
            netns.host_argv(
                config.network, 2, config.hostname(2), str(tmp_path / "w"), [], ["sleep", "600"]
            )
        )
        deadline = time.monotonic() + 10
        while not netns.namespace_pids(config.network.namespace(2)):
            assert time.monotonic() < deadline, "the host's process did not start"
            time.sleep(0.1)
        netns.remove_abandoned(config.network)
        assert len(netns.leftovers(config.network)) == 5  # kept: a host runs a process
        netns.kill_host(config.network, 2)
        proc.wait(timeout=10)
        netns.remove_abandoned(config.network)
        assert netns.leftovers(config.network) == []
    finally:
        netns.destroy(config.network)


@pytest.mark.slow
def test_sigterm_while_starting_removes_everything(tmp_path: Path) -> None:
    """`python -m infra.hosts up` stopped by SIGTERM while its services start: it exits,
    and no namespace, link or process of it is left."""
    env = {
        **env_without_platform(PYTHONPATH=str(REPO)),
        "DET_TASKS_HOSTS_DIR": str(tmp_path),
        "DET_TASKS_HOSTS_SUBNET": SPARE_SUBNET,
        "DET_TASKS_HOSTS_PREFIX": prefix("s"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.hosts", "up"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    network = netns.Network(hosts=2, subnet=env["DET_TASKS_HOSTS_SUBNET"], prefix=prefix("s"))
    mlflow_pid = tmp_path / "stack" / "pids" / "mlflow.pid"
    deadline = time.monotonic() + 120
    while not mlflow_pid.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    started = [int(p.read_text()) for p in (tmp_path / "stack" / "pids").glob("*.pid")]
    assert started and len(netns.leftovers(network)) == 5, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert netns.leftovers(network) == [], err[-3000:]
    for pid in started:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived SIGTERM"
