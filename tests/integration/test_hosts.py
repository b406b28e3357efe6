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
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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
    home_env,
    isolated_stack_config,
    run_xor_trial,
)

pytestmark = pytest.mark.skipif(
    netns.missing_requirements() is not None, reason=str(netns.missing_requirements())
)

_OFFSET = int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0"))
# A subnet and names of the tests' own: apart from `python -m infra.hosts up` (10.77.0, dth)
# and from a second checkout testing at once (its own port offset).
SUBNET = f"10.79.{_OFFSET // 10 % 250}"

# What `det experiment create` does, in one process: ship the model directory as an S3
# package, then run the experiment flow from it (workers never see the checkout's copy).
FLOW_FROM_PACKAGE = """
import json, sys
from pathlib import Path
from det_tasks.checkpoints.model_package import pack_model_dir
from registry.packages import upload_package
from flows.experiment import experiment

model, config = Path(sys.argv[1]), Path(sys.argv[2])
uri, _ = upload_package(pack_model_dir(model))
state = experiment(config=config.name, overrides=sys.argv[3:], package=uri,
                   config_yaml=config.read_text(), return_state=True)
assert state.is_completed(), state
print(json.dumps({"package": uri, "summary": state.result()}, default=str))
"""


def _config(root: Path, prefix: str, hosts: int = 2) -> hosts_lib.HostsConfig:
    network = netns.Network(hosts=hosts, subnet=SUBNET, prefix=prefix)
    return hosts_lib.HostsConfig.on(root, network, isolated_stack_config(root / "stack", 40))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hosts_lib.Hosts]:
    pytest.importorskip("mlflow", reason="the platform extra is not installed")
    config = _config(tmp_path_factory.mktemp("hosts"), "dtt")
    with hosts_lib.running(config) as cluster:
        yield cluster


def _client_env(cluster: hosts_lib.Hosts, home: Path) -> dict[str, str]:
    """A client on host 0 that knows only the cluster's variables."""
    return env_without_platform(
        **cluster.env,
        PREFECT_HOME=str(home / "prefect"),
        DET_TASKS_HOME=str(home / "det"),
        PYTHONPATH=str(REPO),
    )


def _busy_hosts(cluster: hosts_lib.Hosts) -> set[int]:
    """Hosts whose worker runs a step now, as the scheduler sees it."""
    from distributed import Client

    with Client(cluster.env["DET_TASKS_DASK_SCHEDULER"], timeout=30) as client:
        processing = client.processing()
    return {cluster.host_of(worker) for worker, keys in processing.items() if keys}


def _trial_run(client: Any, experiment_name: str) -> Any | None:
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id])
    return next((r for r in runs if "mlflow.parentRunId" in r.data.tags), None)


def _lose_the_host_holding_the_trial(
    cluster: hosts_lib.Hosts, flow: subprocess.Popen[str], name: str
) -> tuple[int, float]:
    """Once the trial has its first checkpoint, SIGKILL every process of the host training
    it; returns that host and the seconds until a step of it ran on another host."""
    from registry.checkpoints import checkpoint_records
    from registry.tracking import client_for

    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    deadline = time.monotonic() + 300
    while flow.poll() is None and time.monotonic() < deadline:
        trial = _trial_run(mlflow, name)
        if trial is not None and checkpoint_records(mlflow, trial.info.run_id):
            break
        time.sleep(0.2)
    busy = _busy_hosts(cluster)
    assert flow.poll() is None and len(busy) == 1, (busy, flow.poll())
    (victim,) = busy
    cluster.lose(victim)
    lost = time.monotonic()
    while not _busy_hosts(cluster) - {victim} and flow.poll() is None:
        time.sleep(0.2)
    return victim, time.monotonic() - lost


@pytest.mark.slow
def test_a_host_lost_mid_trial_continues_on_another_host_bit_equal(
    cluster: hosts_lib.Hosts, tmp_path: Path
) -> None:
    import torch

    from det_tasks import pytorch
    from registry.checkpoints import checkpoint_records
    from registry.tracking import client_for

    name = "hosts-lost"
    reference = run_xor_trial(
        "hosts-reference", 120, home_env(tmp_path / "ref"), FLOW_MODEL,
        "--checkpoint-dir", str(tmp_path / "ref-checkpoints"),
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = json.loads(reference.stdout[reference.stdout.index("{") :])
    flow = subprocess.Popen(
        [sys.executable, "-c", FLOW_FROM_PACKAGE, str(FLOW_MODEL),
         str(FLOW_MODEL / "killable.yaml"), f"name={name}", "hyperparameters.sleep_s=0.1"],
        env=_client_env(cluster, tmp_path / "client"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        victim, to_elsewhere_s = _lose_the_host_holding_the_trial(cluster, flow, name)
        out, err = flow.communicate(timeout=300)
    finally:
        if flow.poll() is None:
            flow.kill()
    assert flow.returncode == 0, err[-4000:]
    got = json.loads(out.strip().splitlines()[-1])["summary"]
    (survivor,) = set(cluster.workers) - {victim}
    print(f"host {victim} lost; its trial ran on host {survivor} {to_elsewhere_s:.1f} s later")

    # Bit-equal to the undisturbed run: its validation, and every weight.
    assert got["best"]["batches_trained"] == 120
    assert got["best"]["metric"] == want["validation"]["validation_loss"]
    with environment(**cluster.env):  # runs:/ URIs resolve through the cluster's MLflow
        got_trial = pytorch.load_trial_from_checkpoint_path(got["best"]["checkpoint"])
    # Written under another home (its own signing key): loaded with the class, as code.
    ref_trial = pytorch.load_trial_from_checkpoint_path(
        want["checkpoint"], trial_class=type(got_trial)
    )
    for a, b in zip(
        ref_trial.model.state_dict().values(), got_trial.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)

    # MLflow: no step twice, none missing at the end; each checkpoint once; nothing RUNNING.
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    trial = _trial_run(mlflow, name)
    assert trial is not None
    steps = [m.step for m in mlflow.get_metric_history(trial.info.run_id, "training/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 120, steps
    records = checkpoint_records(mlflow, trial.info.run_id)
    assert [r["steps_completed"] for r in records] == [30, 60, 90, 120]
    experiment = mlflow.get_experiment_by_name(name)
    runs = mlflow.search_runs([experiment.experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED"}

    # The flow's step logs name the worker that ran each step: all on the survivor's
    # address, the first restored from a checkpoint (the victim's steps never ended).
    ran_on = re.findall(r" on tcp://([\d.]+):\d+ \((warm|restored from [^,]+)", err)
    assert ran_on and {ip for ip, _ in ran_on} == {cluster.address(survivor)}, ran_on
    assert ran_on[0][1].startswith("restored from runs:/"), ran_on
    # ... and the host by its own name, the survivor's hostname (not the machine's).
    named = re.findall(r" s\) on host (\S+?)(?::|\s|$)", err)
    assert named and set(named) == {cluster.hostname(survivor)}, named
    run_key = mlflow.get_run(trial.data.tags["mlflow.parentRunId"]).data.tags["det.experiment_run"]
    _a_step_names_its_host(
        cluster, trial, run_key, json.loads(out.strip().splitlines()[-1])["package"]
    )


def _a_step_names_its_host(
    cluster: hosts_lib.Hosts, trial: Any, run_key: str, package: str
) -> None:
    """A step's StepResult names the namespace's hostname, and the worker is on that host:
    validate @120 of the finished trial, restored from its checkpoint through S3 on
    whichever host takes it, gives the run's own final validation again."""
    from distributed import Client

    from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin, StepRequest
    from cluster.steps import submit_step
    from det_tasks.runner.held import TrialSpec

    hparams = {k[3:]: v for k, v in trial.data.params.items() if k.startswith("hp.")}
    spec = TrialSpec(
        config_path="killable.yaml",  # replaced on the worker by the package's paths
        model_dir="model",
        overrides=("name=hosts-lost", "hyperparameters.sleep_s=0"),
        trial_id=1,
        hparams={k: json.loads(v) for k, v in hparams.items()},
        experiment_run_key=run_key,
    )
    request = StepRequest(
        trial=spec,
        kind="validate",
        start=120,
        stop=120,
        parent_run_id=trial.data.tags["mlflow.parentRunId"],
        experiment_id=trial.info.experiment_id,
        package=package,
        config_yaml=(FLOW_MODEL / "killable.yaml").read_text(),
        release_after=True,
    )
    with (
        environment(**cluster.env),
        Client(cluster.env["DET_TASKS_DASK_SCHEDULER"], timeout=30) as client,
    ):
        client.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
        result = submit_step(request)
    host = cluster.host_of(result.worker)
    assert result.host == cluster.hostname(host) == f"dtt-host-{host}"
    assert result.restored_from and result.validation is not None
    assert result.validation["validation_loss"] == trial.data.metrics["validation/validation_loss"]


def test_down_removes_every_namespace_link_and_process(tmp_path: Path) -> None:
    """What a crashed `up` would leave (a host's namespace with a process in it): `down`
    finds it all by its prefix and removes it."""
    config = _config(tmp_path, "dtd", hosts=2)
    netns.create(config.network)
    try:
        proc = subprocess.Popen(
            netns.host_argv(
                config.network, 1, "dtd-host-1", str(tmp_path / "w"), [], ["sleep", "600"]
            )
        )
        deadline = time.monotonic() + 10
        while not netns.namespace_pids("dtd1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.pid in netns.namespace_pids("dtd1")  # `ip netns exec`, then `sleep`
        assert len(netns.leftovers(config.network)) == 5  # 2 namespaces, 2 veths, the bridge
    finally:
        hosts_lib.down(config)
    assert netns.leftovers(config.network) == []
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.slow
def test_sigterm_while_starting_removes_everything(tmp_path: Path) -> None:
    """`python -m infra.hosts up` stopped by SIGTERM while its services start: it exits,
    and no namespace, link or process of it is left."""
    env = {
        **env_without_platform(PYTHONPATH=str(REPO)),
        "DET_TASKS_HOSTS_DIR": str(tmp_path),
        "DET_TASKS_HOSTS_SUBNET": SUBNET.rpartition(".")[0] + f".{(_OFFSET // 10 + 1) % 250}",
        "DET_TASKS_HOSTS_PREFIX": "dts",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.hosts", "up"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    network = netns.Network(hosts=2, subnet=env["DET_TASKS_HOSTS_SUBNET"], prefix="dts")
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
