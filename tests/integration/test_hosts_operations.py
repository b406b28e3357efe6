"""Operations across real hosts (infra/hosts.py, the session's cluster: the services on
host 0, a Dask worker on each of hosts 1 and 2). Needs root and `ip` (CI runs as root):
skipped elsewhere, saying so.

- the services host's MLflow server SIGKILLed mid-run and started again a while later:
  the worker on its own host trains on, its metrics wait in its sink and arrive once
  MLflow is back, every one of them exactly once, and the experiment ends bit-equal to an
  undisturbed run;
- `det experiment pause`, the host that held the trial lost while it is paused, then
  `det experiment activate`: the trial resumes on the other host from its pause checkpoint
  and ends bit-equal to an undisturbed run, every step and checkpoint recorded once.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from det_cli.ids import experiment_run
from infra import hosts as hosts_lib
from infra.services import Service, start
from infra.stack import deploy, deployments_current, mlflow_service
from tests.integration.helpers import FLOW_MODEL, environment, wait_for
from tests.integration.hosts_helpers import (
    assert_bit_equal_and_recorded_once,
    busy_hosts,
    finished_flow,
    killed_on_error,
    needs_hosts,
    start_flow,
    trial_run,
    wait_for_checkpoints,
)

pytestmark = needs_hosts

MLFLOW_DOWN_S = 10  # plus the restart's own start-up: the server is away for longer


def _kill_group(service: Service) -> float:
    """SIGKILL the service's whole process group (MLflow's server, its uvicorn workers and
    job consumers), as tests/integration/test_faults.py does; returns when."""
    os.killpg(int(service.pidfile.read_text().strip()), signal.SIGKILL)
    return time.time()


@pytest.mark.slow
def test_mlflow_restarted_on_the_services_host_loses_and_repeats_no_metric(
    cluster: hosts_lib.Hosts, hosts_reference: dict[str, Any], tmp_path: Path
) -> None:
    from registry.runs.tracking import client_for

    name = "hosts-mlflow-restart"
    # scheduling_unit=1: training metrics reported every batch (the default, 100, reports at
    # 30, 60, 90, 100 and 120 only), so dozens of points fall inside the outage. Reporting
    # changes no number: the run still ends bit-equal to the reference's defaults.
    flow = start_flow(
        cluster, tmp_path / "client", name, "hyperparameters.sleep_s=0.25", "scheduling_unit=1"
    )
    server = mlflow_service(cluster.config.stack)
    with killed_on_error(flow):
        try:
            wait_for_checkpoints(cluster, flow, name)
            (trainer,) = busy_hosts(cluster)
            killed_at = _kill_group(server)
            time.sleep(MLFLOW_DOWN_S)
        finally:
            start(server)  # back, whatever happened: the later tests need it
        back_at = time.time()
        assert flow.poll() is None, "the experiment ended while MLflow was down"
    summary, _ = finished_flow(flow)
    trial = assert_bit_equal_and_recorded_once(
        cluster, name, summary, hosts_reference, list(range(1, 121))
    )

    # While MLflow was down the worker trained on. Its sink (registry/metrics/sink.py) only
    # queued each batch's report on the training thread; the sender's log-batch requests
    # failed and were kept and retried with backoff (up to 10 s apart), and once the server
    # answered, a batch whose request had failed midway was checked against the stored
    # history first. The checkpoint at 60 went to S3 while its MLflow record waited in the
    # background publisher (MLflow's client retrying); the checkpoint at 90 waits for it
    # (one checkpoint in flight), so a longer outage holds training there until MLflow is
    # back (seen here: batch 90 at 14 s into a 50 s outage, batch 91 19 s after it ended).
    # Every batch's point is stored once: none lost in the outage, none sent twice.
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    points = mlflow.get_metric_history(trial.info.run_id, "training/loss")
    assert [p.step for p in points] == list(range(1, 121))
    during = [p.step for p in points if killed_at * 1000 <= p.timestamp <= back_at * 1000]
    print(f"MLflow down {back_at - killed_at:.1f} s; host {trainer} reported {len(during)} steps")
    assert len(during) >= 10, f"only steps {during} were reported while MLflow was down"


# ---- pause -> activate onto another host -------------------------------------------------


@contextlib.contextmanager
def _client_of(cluster: hosts_lib.Hosts, home: Path) -> Iterator[None]:
    """This process as a user's shell on host 0 with the cluster's variables (what `det`
    reads), Prefect's settings read again on the way in and out (it reads them at import)."""
    from prefect.context import refresh_global_settings_context

    homes = {"PREFECT_HOME": str(home / "prefect"), "DET_TASKS_HOME": str(home / "det")}
    for folder in homes.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        with environment(None, **cluster.env, **homes):
            refresh_global_settings_context()
            yield
    finally:
        refresh_global_settings_context()


def _det(*args: str) -> str:
    """`det ARGS` in this process; its output, having asserted exit 0."""
    from det_cli import main as det

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = det(list(args))
    assert code == 0, (args, out.getvalue())
    return out.getvalue()


def _flow_logs(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as prefect:
        logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in sorted(logs, key=lambda log: log.timestamp)]


@pytest.mark.slow
def test_pause_lose_its_host_then_activate_resumes_on_the_other_host_bit_equal(
    cluster: hosts_lib.Hosts, hosts_reference: dict[str, Any], tmp_path: Path
) -> None:
    from registry.runs.tracking import client_for

    name = "hosts-pause"
    if not deployments_current(cluster.config.stack):  # `make up` registers them
        deploy(cluster.config.stack)
    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    with _client_of(cluster, tmp_path / "client"):
        created = _det(
            "experiment", "create", str(FLOW_MODEL / "killable.yaml"), str(FLOW_MODEL),
            "--config", f"name={name}", "--config", "hyperparameters.sleep_s=0.1",
        )  # fmt: skip
        exp_id = re.search(r"Created experiment (\S+)", created).group(1)  # type: ignore[union-attr]
        with _killed_on_error(exp_id):
            moved = _pause_lose_activate(cluster, mlflow, name, exp_id)
    print(f"paused at batch {moved.paused_at} on host {moved.holder}; activated onto {moved.other}")

    # The step logs name where each step ran: before the pause on the holder, after it on
    # the other host, the first of those restored from the pause checkpoint.
    ran_on = re.findall(
        r" on tcp://([\d.]+):\d+ \((warm|restored from [^,]+)", "\n".join(moved.logs)
    )
    addresses = [ip for ip, _ in ran_on]
    resumed = addresses.index(cluster.address(moved.other))
    assert set(addresses[:resumed]) == {cluster.address(moved.holder)}, ran_on
    assert set(addresses[resumed:]) == {cluster.address(moved.other)}, ran_on
    assert ran_on[resumed][1] == f"restored from {moved.pause_uri}", ran_on

    _assert_resumed_bit_equal(cluster.env, moved.run_id, name, moved.paused_at, hosts_reference)


@contextlib.contextmanager
def _killed_on_error(exp_id: str) -> Iterator[None]:
    """The experiment killed if the block fails: it must not train on into the next test."""
    try:
        yield
    except BaseException:
        from flows.lifecycle import kill

        with contextlib.suppress(Exception):
            print(kill(str(experiment_run(exp_id).id)))
        raise


class _Moved(NamedTuple):
    run_id: str  # the trial's MLflow run
    holder: int  # the host that trained it until the pause, then was lost
    other: int
    paused_at: int
    pause_uri: str  # the pause checkpoint
    logs: list[str]  # the flow run's log lines


def _pause_lose_activate(cluster: hosts_lib.Hosts, mlflow: Any, name: str, exp_id: str) -> _Moved:
    """Pause once the trial has its first checkpoint, lose the host that held it while it is
    paused, activate, and wait for the experiment's end."""
    from registry.checkpoints.store import checkpoint_records

    def checkpointed() -> Any:
        trial = trial_run(mlflow, name)
        if trial and checkpoint_records(mlflow, trial.info.run_id):
            return trial
        run = experiment_run(exp_id)
        assert run.state in ("SCHEDULED", "PENDING", "RUNNING"), _flow_logs(run.id)[-20:]
        return None

    run_id = wait_for(checkpointed, 300, "a first checkpoint").info.run_id
    (holder,) = busy_hosts(cluster)
    _det("experiment", "pause", exp_id)  # as users pause
    wait_for(lambda: experiment_run(exp_id).state == "PAUSED", 120, "the flow run suspended")
    paused = mlflow.get_run(run_id)
    assert paused.info.status == "KILLED" and paused.data.tags["det.state"] == "PAUSED"
    pause_checkpoint = checkpoint_records(mlflow, run_id)[-1]
    paused_at = int(pause_checkpoint["steps_completed"])
    assert 30 < paused_at < 120, paused_at

    # The host that held the trial is gone while it is paused: activate must restore the
    # trial from its pause checkpoint through S3 on the other host.
    cluster.lose(holder)
    (other,) = set(cluster.workers) - {holder}
    _det("experiment", "activate", exp_id)
    # What `det experiment wait` polls, with a deadline: a hang must fail, not stall CI.
    ended = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
    flow_run = wait_for(lambda: _ended(experiment_run(exp_id), ended), 300, "the end")
    assert flow_run.state == "COMPLETED", (flow_run.state, _flow_logs(flow_run.id)[-20:])
    logs = _flow_logs(flow_run.id)
    return _Moved(run_id, holder, other, paused_at, pause_checkpoint["uri"], logs)


def _ended(run: Any, states: tuple[str, ...]) -> Any:
    return run if run.state in states else None


def _assert_resumed_bit_equal(
    env: dict[str, str], run_id: str, name: str, paused_at: int, want: dict[str, Any]
) -> None:
    """The trial's last checkpoint holds the undisturbed run's weights and validation; each
    training report and checkpoint is in MLflow once (the pause's among them), and no run of
    the experiment is left RUNNING."""
    import torch

    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    mlflow = client_for(env["MLFLOW_TRACKING_URI"])
    records = checkpoint_records(mlflow, run_id)
    assert [r["steps_completed"] for r in records] == sorted({30, 60, 90, 120, paused_at})
    with environment(None, **env):  # runs:/ URIs resolve through the cluster's MLflow
        got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
    ref = pytorch.load_trial_from_checkpoint_path(want["checkpoint"], trial_class=type(got))
    for a, b in zip(ref.model.state_dict().values(), got.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    validation = mlflow.get_metric_history(run_id, "validation/validation_loss")
    steps = [m.step for m in validation]
    assert steps == sorted(set(steps)) and steps[-1] == 120, steps
    assert validation[-1].value == want["validation"]["validation_loss"]
    # Training is reported every scheduling_unit (100), at each checkpoint, and at the pause.
    training = [m.step for m in mlflow.get_metric_history(run_id, "training/loss")]
    assert training == sorted({30, 60, 90, 100, 120, paused_at}), training
    experiment = mlflow.get_experiment_by_name(name)
    assert experiment is not None
    runs = mlflow.search_runs([experiment.experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
