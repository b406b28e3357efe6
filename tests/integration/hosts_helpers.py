"""What the multi-host tests share (tests/integration/test_hosts*.py): the cluster's
config, a client on host 0 that knows only the cluster's variables, the experiment flow run
from an S3 package as `det experiment create` runs it, and what the scheduler and MLflow say
about where a trial is."""

from __future__ import annotations

import contextlib
import json
import os
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

# Every multi-host test needs root and `ip` (CI runs as root): skipped elsewhere, saying so.
needs_hosts = pytest.mark.skipif(
    netns.missing_requirements() is not None, reason=str(netns.missing_requirements())
)

_OFFSET = int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0"))
# A subnet and names of the tests' own: apart from `python -m infra.hosts up` (10.77.0, dth)
# and from a second checkout testing at once (its own port offset).
SUBNET = f"10.79.{_OFFSET // 10 % 250}"
SPARE_SUBNET = f"10.79.{(_OFFSET // 10 + 1) % 250}"  # a second cluster's, at once


def prefix(role: str) -> str:
    """Names for a cluster of this checkout's (``role``: one letter), apart from another
    checkout's testing at once: no prefix is the start of another's."""
    return f"t{_OFFSET // 10 % 1000}{role}"


# What `det experiment create` does, in one process: ship the model directory as an S3
# package, then run the experiment flow from it (workers never see the checkout's copy).
FLOW_FROM_PACKAGE = """
import json, sys
from collections.abc import Iterator
from pathlib import Path
from det_tasks.checkpoints.model_package import pack_model_dir
from registry.experiments.packages import upload_package
from flows.experiment import experiment

model, config = Path(sys.argv[1]), Path(sys.argv[2])
uri, _ = upload_package(pack_model_dir(model))
state = experiment(config=config.name, overrides=sys.argv[3:], package=uri,
                   config_yaml=config.read_text(), return_state=True)
assert state.is_completed(), state
print(json.dumps({"package": uri, "summary": state.result()}, default=str))
"""


def hosts_config(
    root: Path, prefix: str, hosts: int = 2, subnet: str = SUBNET
) -> hosts_lib.HostsConfig:
    network = netns.Network(hosts=hosts, subnet=subnet, prefix=prefix)
    return hosts_lib.HostsConfig.on(root, network, isolated_stack_config(root / "stack", 40))


def client_env(cluster: hosts_lib.Hosts, home: Path) -> dict[str, str]:
    """A client on host 0 that knows only the cluster's variables."""
    return env_without_platform(
        **cluster.env,
        PREFECT_HOME=str(home / "prefect"),
        DET_TASKS_HOME=str(home / "det"),
        PYTHONPATH=str(REPO),
    )


def start_flow(
    cluster: hosts_lib.Hosts, home: Path, name: str, *overrides: str
) -> subprocess.Popen[str]:
    """The killable XOR experiment ``name`` (120 batches, a checkpoint every 30), shipped as
    a package and run by a client on host 0."""
    return subprocess.Popen(
        [sys.executable, "-c", FLOW_FROM_PACKAGE, str(FLOW_MODEL),
         str(FLOW_MODEL / "killable.yaml"), f"name={name}", *overrides],
        env=client_env(cluster, home),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def busy_hosts(cluster: hosts_lib.Hosts) -> set[int]:
    """Hosts whose worker runs a step now, as the scheduler sees it."""
    from distributed import Client

    with Client(cluster.env["DET_TASKS_DASK_SCHEDULER"], timeout=30) as client:
        processing = client.processing()
    return {cluster.host_of(worker) for worker, keys in processing.items() if keys}


def trial_run(client: Any, experiment_name: str) -> Any | None:
    """The experiment's (only) trial run, None before it exists."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id])
    return next((r for r in runs if "mlflow.parentRunId" in r.data.tags), None)


def wait_for_checkpoints(
    cluster: hosts_lib.Hosts, flow: subprocess.Popen[str], name: str, count: int = 1
) -> Any:
    """The trial run once it has ``count`` checkpoints recorded (the flow still running)."""
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    deadline = time.monotonic() + 300
    while flow.poll() is None and time.monotonic() < deadline:
        trial = trial_run(mlflow, name)
        if trial is not None and len(checkpoint_records(mlflow, trial.info.run_id)) >= count:
            return trial
        time.sleep(0.2)
    raise AssertionError(f"no {count} checkpoints of {name}; the flow ended {flow.poll()}")


def undisturbed_reference(home: Path) -> dict[str, Any]:
    """The killable XOR trial's 120 batches run undisturbed by `det-tasks run` (its
    ``validation`` and ``checkpoint``): what every fault test must end bit-equal to."""
    reference = run_xor_trial(
        "hosts-reference", 120, home_env(home), FLOW_MODEL,
        "--checkpoint-dir", str(home / "checkpoints"),
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    return json.loads(reference.stdout[reference.stdout.index("{") :])


@contextlib.contextmanager
def killed_on_error(flow: subprocess.Popen[str]) -> Iterator[None]:
    """The flow killed if the block fails (a failed wait must not leave it running)."""
    try:
        yield
    except BaseException:
        flow.kill()
        flow.communicate()
        raise


def finished_flow(flow: subprocess.Popen[str], timeout_s: float = 300) -> tuple[dict, str]:
    """The flow's summary and its stderr (the step logs) once it ended 0."""
    try:
        out, err = flow.communicate(timeout=timeout_s)
    finally:
        if flow.poll() is None:
            flow.kill()
    assert flow.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


# Where the killable trial reports training metrics: each scheduling_unit (100) and each
# checkpoint (every 30), as Determined's harness did.
TRAINING_STEPS = [30, 60, 90, 100, 120]


def assert_bit_equal_and_recorded_once(
    cluster: hosts_lib.Hosts,
    name: str,
    summary: dict[str, Any],
    want: dict[str, Any],
    training_steps: list[int] = TRAINING_STEPS,
    checkpoint_steps: tuple[int, ...] = (30, 60, 90, 120),
) -> Any:
    """The experiment ended as the undisturbed run did (its validation and every weight),
    and MLflow holds each training step of ``training_steps`` once, none missing, and each
    checkpoint once, with no run left RUNNING. Returns the trial run."""
    import torch

    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    got = summary["summary"]
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

    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    trial = trial_run(mlflow, name)
    assert trial is not None
    history = mlflow.get_metric_history(trial.info.run_id, "training/loss")
    assert sorted(m.step for m in history) == training_steps, history
    validations = mlflow.get_metric_history(trial.info.run_id, "validation/validation_loss")
    assert [m.step for m in validations] == [120], validations
    records = checkpoint_records(mlflow, trial.info.run_id)
    assert [r["steps_completed"] for r in records] == list(checkpoint_steps)
    experiment = mlflow.get_experiment_by_name(name)
    runs = mlflow.search_runs([experiment.experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED"}
    return trial
