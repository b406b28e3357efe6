"""Experiments as a DAG on warm Dask workers, on the real stack (Prefect server, MLflow, S3,
the stack's Dask scheduler and workers):

- the graph: every trial is a chain of named tasks, each linked to the one before, read back
  through Prefect's API; tasks carry their MLflow run; the flow run has a table of trials;
- warm reuse: a trial is built once per chain of segments, in long-lived worker processes;
- position-addressed recovery: a step for a batch the worker does not hold restores the
  checkpoint before it and replays to exactly the same validation;
- scale-out: two workers started as separate hosts share one experiment's trials, and
  killing one host mid-trial lets the trial finish on the other with identical weights.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from det_tasks import pytorch
from det_tasks.runner.held import TrialSpec
from infra import dask_cluster
from infra.services import Service, start, stop
from registry.checkpoints.models import trial_runs
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"
# Short and ASCII (Prefect's graph font has no "→"): "train trial-3 0-16", "validate trial-3 @16".
NAME = re.compile(r"^(train|validate|checkpoint) trial-(\d+) ((\d+)-(\d+)|@(\d+))$")


def _mlflow() -> Any:
    return client_for(os.environ["MLFLOW_TRACKING_URI"])


def _run(config: str, overrides: list[str]) -> tuple[dict[str, Any], str]:
    from flows.experiment import experiment

    state = experiment(str(FLOW_MODEL / config), overrides, return_state=True)
    assert state.is_completed(), state
    return state.result(), str(state.state_details.flow_run_id)


def _trials(experiment_name: str, run_key: str) -> list[Any]:
    client = _mlflow()
    exp = client.get_experiment_by_name(experiment_name)
    (parent,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`det.experiment_run` = '{run_key}'"
    )
    return trial_runs(client, parent)


def test_trials_are_linked_chains_of_named_tasks_on_warm_workers(stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
    )

    pid_file = tmp_path / "pids"
    _, flow_run_id = _run(
        "asha.yaml", ["searcher.max_trials=4", "name=warm-graph", f"data.pid_file={pid_file}"]
    )
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id={"any_": [flow_run_id]})
        )
    by_trial: dict[int, list[Any]] = {}
    for task in tasks:
        match = NAME.match(task.name)
        assert match, f"task name {task.name!r} does not name its step and trial"
        by_trial.setdefault(int(match.group(2)), []).append(task)
    trials = _trials("warm-graph", flow_run_id)
    mlflow_runs = {t.data.tags["det.trial_id"]: t.info.run_id for t in trials}
    assert sorted(by_trial) == [1, 2, 3, 4]
    segments = 0
    for chain in by_trial.values():
        chain.sort(key=lambda t: t.start_time)
        kinds = [t.name.split()[0] for t in chain]
        assert kinds == ["train", "validate", "checkpoint"] * (len(chain) // 3), kinds
        segments += len(chain) // 3
        # Each task's input is the task before it: one chain per trial in the graph.
        assert not chain[0].task_inputs.get("after")
        for before, task in itertools.pairwise(chain):
            linked = {getattr(i, "id", None) for i in task.task_inputs["after"]}
            assert linked == {before.id}, (task.name, before.name)
        for task in chain:
            assert len(task.name) <= 32 and task.name.isascii(), task.name
            # No Prefect tags: each would cost a concurrency-slot write before the task starts.
            assert task.tags == []
    # ASHA (rungs 16/32/64, divisor 2, 4 trials): 4 + 2 + 1 segments; promotions extend chains.
    assert segments == 7
    assert max(len(c) for c in by_trial.values()) == 9
    # Warm: every validate and checkpoint task found its trial held by the worker that
    # trained it (its log says so), trials are built far fewer times than there are tasks,
    # and all of it ran in as many long-lived processes as the stack has workers.
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [flow_run_id]}))
    how = {log.task_run_id: log.message for log in logs if " on tcp://" in log.message}
    # Each task's log line names its trial's MLflow run (the name no longer carries it).
    for trial_id, chain in by_trial.items():
        for task in chain:
            assert f"(MLflow run {mlflow_runs[str(trial_id)]})" in how[task.id], task.name
    cold = [
        (t.name, t.run_count, how.get(t.id))
        for chain in by_trial.values()
        for t in chain
        if not t.name.startswith("train") and "(warm," not in str(how.get(t.id))
    ]
    assert not cold, cold
    builds = pid_file.read_text().split()
    assert len(builds) < 3 * segments
    assert len(set(builds)) <= int(os.environ.get("DET_TASKS_DASK_WORKERS", "2"))

    table = max((a for a in artifacts if a.type == "table"), key=lambda a: a.created)
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert sorted(r["trial"] for r in rows) == [1, 2, 3, 4]
    for row in rows:
        assert row["best checkpoint"].startswith("runs:/")
        assert mlflow_runs[str(row["trial"])] in row["mlflow"]
    assert {r["batches"] for r in rows} == {16, 32, 64}
    # What happened to each trial, in the same word in the table, in MLflow and in describe:
    # trained to max_length (64) COMPLETED, the rest STOPPED by ASHA; both runs FINISHED.
    from registry.experiments.view import describe_experiment_run

    expected = {str(r["trial"]): "COMPLETED" if r["batches"] == 64 else "STOPPED" for r in rows}
    assert {str(r["trial"]): r["state"] for r in rows} == expected
    assert {t.data.tags["det.trial_id"]: t.data.tags["det.state"] for t in trials} == expected
    assert {t.info.status for t in trials} == {"FINISHED"}
    view = describe_experiment_run(_mlflow(), flow_run_id)
    assert view is not None and {t.trial_id: t.state for t in view.trials} == expected


def test_a_flow_runs_log_is_whole_the_moment_it_says_completed(stack, monkeypatch):
    """Prefect sends log lines to its API in batches; a script reading a flow run's log as
    soon as the run says Completed gets every task's line, the last checkpoint's included.
    The batch interval is a minute here, so only the flow's own delivery, never a batch
    falling due, can have put those lines on the server (at the default 2 s this raced)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter
    from prefect.context import refresh_global_settings_context

    from flows.log_delivery import deliver_logs

    deliver_logs()  # the log worker now starts under the long interval
    monkeypatch.setenv("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "60")
    refresh_global_settings_context()
    try:
        _, flow_run_id = _run(
            "killable.yaml",
            ["name=whole-log", "hyperparameters.sleep_s=0", "searcher.max_length={batches: 20}"],
        )
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [flow_run_id]}))
    finally:
        deliver_logs()
        monkeypatch.delenv("PREFECT_LOGGING_TO_API_BATCH_INTERVAL")
        refresh_global_settings_context()
    (trial,) = _trials("whole-log", flow_run_id)
    lines = [log.message for log in logs]
    run = f"(MLflow run {trial.info.run_id})"
    assert any(run in line and "checkpoint at batch 20 " in line for line in lines), lines
    assert any(line.startswith("summary: ") for line in lines), lines


def test_a_step_for_a_batch_the_worker_does_not_hold_replays_exactly(stack):
    """validate @45 on a worker without the trial: restore the checkpoint at 30, replay
    15 batches, validate: the same metrics as the run's own validation at 45."""
    from distributed import Client

    from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin, StepRequest
    from cluster.steps import release_everywhere, submit_step

    overrides = [
        "name=warm-replay",
        "hyperparameters.sleep_s=0",
        "searcher.max_length={batches: 60}",
        "min_validation_period={batches: 15}",
    ]
    _, run_key = _run("killable.yaml", overrides)
    (trial,) = _trials("warm-replay", run_key)
    history = _mlflow().get_metric_history(trial.info.run_id, "validation/validation_loss")
    at_45 = {m.step: m.value for m in history}[45]
    assert [r["steps_completed"] for r in checkpoint_records(_mlflow(), trial.info.run_id)] == [
        30,
        60,
    ]
    spec = TrialSpec(
        config_path=str(FLOW_MODEL / "killable.yaml"),
        model_dir=str(FLOW_MODEL),
        overrides=tuple(overrides),
        trial_id=1,
        hparams={k[3:]: _param(v) for k, v in trial.data.params.items() if k.startswith("hp.")},
        experiment_run_key=run_key,
    )
    with Client(os.environ["DET_TASKS_DASK_SCHEDULER"]) as client:
        client.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
        release_everywhere(client)
        request = StepRequest(
            trial=spec,
            kind="validate",
            start=45,
            stop=45,
            parent_run_id=trial.data.tags["mlflow.parentRunId"],
            experiment_id=trial.info.experiment_id,
            release_after=True,
        )
        result = submit_step(request)
    assert not result.warm and result.restored_from and result.position == 45
    assert result.validation is not None
    assert result.validation["validation_loss"] == at_45  # bit-identical replay


def _param(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@pytest.fixture
def two_hosts(stack, tmp_path):
    """A scheduler and two workers started as separate hosts: each in its own working
    directory with its own environment (cache, temp dir, HOME), none in this checkout."""
    from infra.stack import env_for

    port = stack.dask_port + 7
    scheduler = dask_cluster.scheduler_service(tmp_path, port)
    address = dask_cluster.scheduler_address(port)
    hosts: dict[str, Service] = {}
    for name in ("host-a", "host-b"):
        home = tmp_path / name
        env = {**env_for(stack), "HOME": str(home), "DET_TASKS_HOME": str(home / "det")}
        hosts[name] = dask_cluster.worker_service(tmp_path, address, name, home, env)
    services = [scheduler, *hosts.values()]
    saved = os.environ.get("DET_TASKS_DASK_SCHEDULER")
    try:
        for service in services:
            start(service)
        os.environ["DET_TASKS_DASK_SCHEDULER"] = address
        yield address, hosts
    finally:
        if saved is not None:
            os.environ["DET_TASKS_DASK_SCHEDULER"] = saved
        for service in reversed(services):
            stop(service)


def _worker_pids(address: str) -> dict[str, int]:
    """Worker name -> the pid of its worker process."""
    from distributed import Client

    with Client(address) as client:
        pids = client.run(os.getpid)
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    return {names[a]: pid for a, pid in pids.items()}


def test_one_experiment_runs_on_two_hosts_and_survives_losing_one(two_hosts, tmp_path):
    address, hosts = two_hosts
    pid_file = tmp_path / "grid-pids"
    _run("grid.yaml", ["name=two-hosts", f"data.pid_file={pid_file}"])
    pids = _worker_pids(address)
    used = {int(p) for p in pid_file.read_text().split()}
    assert used == set(pids.values()), (used, pids)  # trials ran on both hosts

    killable = ["name=two-hosts-kill", "hyperparameters.sleep_s=0.08"]
    reference, _ = _run("killable.yaml", killable)
    pid_file = tmp_path / "kill-pids"
    result: dict[str, Any] = {}

    def run() -> None:
        result["summary"], result["key"] = _run(
            "killable.yaml", [*killable, f"data.pid_file={pid_file}"]
        )

    thread = threading.Thread(target=run)
    thread.start()
    victim = None
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
        if not pid_file.exists():
            continue
        trials = _trials_of_latest("two-hosts-kill")
        if trials and checkpoint_records(_mlflow(), trials[0].info.run_id):
            time.sleep(0.5)  # a few batches past the checkpoint, re-trained after
            pid = int(pid_file.read_text().split()[0])
            victim = next(name for name, p in pids.items() if p == pid)
            host = hosts[victim]  # the whole host goes: its nanny and worker
            os.killpg(os.getpgid(int(host.pidfile.read_text())), signal.SIGKILL)
    thread.join(timeout=300)
    assert victim is not None, "the trial finished before it could be killed"
    survivor = next(name for name in hosts if name != victim)
    assert int(pid_file.read_text().split()[-1]) == pids[survivor]
    ref = pytorch.load_trial_from_checkpoint_path(reference["best"]["checkpoint"])
    got = pytorch.load_trial_from_checkpoint_path(result["summary"]["best"]["checkpoint"])
    for a, b in zip(ref.model.state_dict().values(), got.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _trials_of_latest(experiment_name: str) -> list[Any]:
    client = _mlflow()
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`det.experiment_run` != ''",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return trial_runs(client, runs[0]) if runs else []
