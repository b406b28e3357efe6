"""The Prefect flows against a real Prefect server + process worker and the MLflow/S3 stack:
a deployment run, grid and ASHA searches with concurrency, a SIGKILLed trial that resumes
exactly, resumable batch inference, and a bad override refused before training."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest
import torch

from det_tasks import ConfigError, pytorch
from flows.work_pool import engine_command
from infra.stack import POOL, deploy
from registry.checkpoints.models import best_checkpoint, register_checkpoint, trial_runs
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"


def mlflow():
    return client_for(os.environ["MLFLOW_TRACKING_URI"])


def parent_and_trials(experiment_name: str, run_key: str):
    client = mlflow()
    exp = client.get_experiment_by_name(experiment_name)
    parents = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`det.experiment_run` = '{run_key}'"
    )
    assert len(parents) == 1
    return parents[0], trial_runs(client, parents[0])


def test_deployment_run_experiment_const_through_server_and_worker(stack):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    deploy(stack)
    # The stack's pool starts each flow run's engine itself, in the stack's interpreter, in
    # a session of its own, with no workspace supervisor before it (flows.work_pool,
    # flows.engine_session), forked by the stack's warm starter (flows.flow_starter): the
    # run below goes that way.
    with get_client(sync_client=True) as prefect:
        template = prefect.read_work_pool(POOL).base_job_template
    assert template["variables"]["properties"]["command"]["default"] == engine_command()
    flow_run = run_deployment(
        "experiment/const",
        parameters={
            "config": "examples/mnist/const.yaml",
            "overrides": ["searcher.max_length.epochs=2"],
        },
        timeout=600,
    )
    assert flow_run.state is not None and flow_run.state.is_completed(), flow_run.state
    starter_log = (stack.root / "logs" / "flow-starter.log").read_text()
    assert f"flow run {flow_run.id} is pid" in starter_log
    parent, trials = parent_and_trials("mnist-const", str(flow_run.id))
    assert len(trials) == 1
    history = mlflow().get_metric_history(trials[0].info.run_id, "training/loss")
    assert [m.step for m in history][-1] == 44
    records = checkpoint_records(mlflow(), trials[0].info.run_id)
    assert records and records[-1]["steps_completed"] == 44
    bucket, _, key = records[-1]["s3_uri"][5:].partition("/")
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    assert s3.head_object(Bucket=bucket, Key=f"{key}/state_dict.pth")["ContentLength"] > 0
    assert parent.info.status == "FINISHED"


def test_grid_of_four_with_concurrency_two(stack):
    from flows.experiment import experiment

    summary = experiment(str(FLOW_MODEL / "grid.yaml"))
    assert summary["best"]["batches_trained"] == 40
    _, trials = parent_and_trials("flow-grid", _last_run_key("flow-grid"))
    assert len(trials) == 4
    hps = sorted((t.data.params["hp.learning_rate"], t.data.params["hp.hidden"]) for t in trials)
    assert hps == [("0.05", "4"), ("0.05", "8"), ("0.2", "4"), ("0.2", "8")]
    # What a user sees (issue 17): the winner on the parent run, links that open the runs
    # table in MLflow's "Model training" workspace, the real trial id in metadata.json.
    from mlflow.tracking import MlflowClient

    from registry.checkpoints.uris import fetch_checkpoint_uri as _fetch

    best = summary["best"]
    parent_id = summary["mlflow_parent_run"].split("?")[0].rsplit("/", 1)[-1]
    parent = MlflowClient().get_run(parent_id)
    assert parent.data.tags["det.best.trial_id"] == str(best["trial_id"])
    assert summary["mlflow_experiment"].endswith(
        "/runs?viewStateShareKey=det-trials&workflowType=machine_learning"
    )
    assert {"experiment.html", "learning_curves.png"} <= {
        a.path for a in MlflowClient().list_artifacts(parent_id)
    }
    metadata = json.loads((_fetch(best["checkpoint"]) / "metadata.json").read_text())
    assert metadata["trial_id"] == str(best["trial_id"])
    # Prefect's side (issue 28): one trials table, updated in place, best first, and one
    # progress artifact, however often the flow published them.
    from tests.integration.prefect_artifacts import trials_table_and_progress

    rows, progress = trials_table_and_progress(_last_run_key("flow-grid"))
    assert sorted(r["trial"] for r in rows) == [1, 2, 3, 4] and progress == 100.0
    assert str(rows[0]["trial"]) == parent.data.tags["det.best.trial_id"]


def test_asha_stops_worse_trials_early(stack):
    from flows.experiment import experiment

    experiment(str(FLOW_MODEL / "asha.yaml"))
    parent, trials = parent_and_trials("flow-asha", _last_run_key("flow-asha"))
    client = mlflow()
    trained = {}
    rung0 = {}
    for t in trials:
        steps = [m.step for m in client.get_metric_history(t.info.run_id, "training/loss")]
        trained[t.data.tags["det.trial_id"]] = max(steps)
        val = {
            m.step: m.value
            for m in client.get_metric_history(t.info.run_id, "validation/validation_loss")
        }
        rung0[t.data.tags["det.trial_id"]] = val[16]
    assert len(trials) == 8
    # Rungs at 16, 32, 64 batches with divisor 2: 8 -> 4 -> 2.
    assert sorted(trained.values()) == [16, 16, 16, 16, 32, 32, 64, 64]
    promoted = {t for t, b in trained.items() if b > 16}
    # Promotion is asynchronous, so a promoted trial beats every trial reported before it;
    # here: the best trial at rung 0 is always promoted and the worst never is.
    ranked = sorted(rung0, key=rung0.get)
    assert ranked[0] in promoted and ranked[-1] not in promoted
    # MLflow says what happened to each: trained to max_time COMPLETED, the rest STOPPED by
    # the searcher; both are normal ends (FINISHED), as Optuna's MLflow callback ends pruned
    # trials.
    states = {t.data.tags["det.trial_id"]: t.data.tags["det.state"] for t in trials}
    assert states == {t: "COMPLETED" if b == 64 else "STOPPED" for t, b in trained.items()}
    assert {t.info.status for t in trials} == {"FINISHED"}
    # The parent run logs the search's settings as params, flattened as hp.* are.
    params = parent.data.params
    assert params["searcher.name"] == "adaptive_asha"
    assert params["searcher.metric"] == "validation_loss"
    assert params["searcher.smaller_is_better"] == "True"  # the default, filled in
    assert (params["searcher.max_trials"], params["searcher.max_time"]) == ("8", "64")
    assert params["searcher.max_concurrent_trials"] == "2"
    assert (params["searcher.divisor"], params["searcher.max_rungs"]) == ("2.0", "3")
    assert params["resources.slots_per_trial"] == "1"
    assert params["reproducibility.experiment_seed"] == "5"
    # System metrics at the default interval: every trial run has its points, one at
    # least (the sample taken when its run ends), numbered from 0.
    for t in trials:
        history = client.get_metric_history(t.info.run_id, "system/cpu_utilization_percentage")
        assert history and sorted(m.step for m in history) == list(range(len(history)))


def test_a_trial_evicted_before_its_release_still_ends_as_the_searcher_stopped_it(
    stack, monkeypatch
):
    """Dask may start two trials' steps on one worker: the second evicts the first between
    its checkpoint and its release, which ends the first's run PAUSED, and the release then
    finds nothing to end (a CI run: a trial ASHA stopped stayed PAUSED in MLflow). Here
    every release is preceded by that eviction, done by the worker's own plugin; each
    trial's run must still end as the searcher ended it."""
    from distributed import default_client

    import flows.trial_releases
    from cluster.worker_calls import release_all
    from flows.experiment import experiment

    real_release_on = flows.trial_releases.release_on
    evicted = []

    def evicted_first(worker, request):
        answers = default_client().run(
            release_all, request.trial.experiment_run_key, None, workers=[worker]
        )
        evicted.append(sum(answers.values()))
        return real_release_on(worker, request)

    monkeypatch.setattr(flows.trial_releases, "release_on", evicted_first)
    name = "flow-asha-evicted"
    experiment(str(FLOW_MODEL / "asha.yaml"), [f"name={name}"])
    _, trials = parent_and_trials(name, _last_run_key(name))
    client = mlflow()
    trained = {
        t.data.tags["det.trial_id"]: max(
            m.step for m in client.get_metric_history(t.info.run_id, "training/loss")
        )
        for t in trials
    }
    assert sorted(trained.values()) == [16, 16, 16, 16, 32, 32, 64, 64]
    stopped = [t for t, b in trained.items() if b < 64]
    assert sum(evicted) >= len(stopped) == 6  # the eviction came first, every time
    states = {t.data.tags["det.trial_id"]: t.data.tags["det.state"] for t in trials}
    assert states == {t: "COMPLETED" if b == 64 else "STOPPED" for t, b in trained.items()}
    assert {t.info.status for t in trials} == {"FINISHED"}


def _last_run_key(experiment_name: str) -> str:
    client = mlflow()
    exp = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`det.experiment_run` != ''",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].data.tags["det.experiment_run"]


def test_sigkilled_trial_resumes_and_matches_an_uninterrupted_run(stack, tmp_path):
    from flows.experiment import experiment

    reference = experiment(str(FLOW_MODEL / "killable.yaml"))
    pid_file = tmp_path / "pids"
    result: dict = {}

    def run() -> None:
        result["summary"] = experiment(
            str(FLOW_MODEL / "killable.yaml"), [f"data.pid_file={pid_file}"]
        )

    thread = threading.Thread(target=run)
    thread.start()
    killed_at = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and killed_at is None:
        time.sleep(0.2)
        if not pid_file.exists():
            continue
        key = _last_run_key("flow-killable")
        _, trials = parent_and_trials("flow-killable", key)
        if trials and checkpoint_records(mlflow(), trials[0].info.run_id):
            steps = [
                r["steps_completed"] for r in checkpoint_records(mlflow(), trials[0].info.run_id)
            ]
            time.sleep(0.6)  # some batches past the checkpoint, which the retry re-trains
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
            killed_at = steps[-1]
    thread.join(timeout=300)
    assert killed_at is not None and killed_at < 120
    assert len(pid_file.read_text().split()) == 2  # the retry ran in a new process
    assert result["summary"]["best"]["metric"] == reference["best"]["metric"]
    _, trials = parent_and_trials("flow-killable", _last_run_key("flow-killable"))
    steps = [m.step for m in mlflow().get_metric_history(trials[0].info.run_id, "training/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 120  # no duplicates, none missing
    ref = pytorch.load_trial_from_checkpoint_path(reference["best"]["checkpoint"])
    got = pytorch.load_trial_from_checkpoint_path(result["summary"]["best"]["checkpoint"])
    for a, b in zip(ref.model.state_dict().values(), got.model.state_dict().values()):
        assert torch.equal(a, b)


def _pinned_xor() -> str:
    from registry.checkpoints.uris import models_uri_source

    return models_uri_source("models:/xor@champion")


def test_batch_inference_resumes_and_writes_every_shard_once(stack):
    from flows.batch_inference import batch_inference, plan_shards, predict_shard
    from flows.experiment import experiment

    experiment(str(FLOW_MODEL / "grid.yaml"), ["searcher.max_trials=1"])
    client = mlflow()
    best = best_checkpoint(client, "flow-grid")
    register_checkpoint(client, "xor", best, alias="champion")
    output = f"s3://det-tasks/predictions/test-{int(time.time())}"
    # A first run that "crashed" after two of five shards.
    requests = plan_shards(_pinned_xor(), "model_def:inputs", 5, output, 7)
    for shard in (0, 3):
        predict_shard.fn(requests[shard])
    summary = batch_inference(
        "models:/xor@champion", "model_def:inputs", num_shards=5, output=output, batch_size=7
    )
    assert summary["shards_skipped"] == 2 and summary["rows"] == 40 - 8 - 8
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    prefix = output[len("s3://det-tasks/") :]
    objects = s3.list_objects_v2(Bucket="det-tasks", Prefix=prefix)["Contents"]
    assert len(objects) == 5
    indices, outputs = [], []
    for obj in sorted(objects, key=lambda o: o["Key"]):
        table = pq.read_table(
            io.BytesIO(s3.get_object(Bucket="det-tasks", Key=obj["Key"])["Body"].read())
        )
        indices += table.column("index").to_pylist()
        outputs += table.column("output").to_pylist()
    assert indices == list(range(40))
    trial = pytorch.load_trial_from_checkpoint_path("models:/xor@champion")
    import sys

    sys.path.insert(0, str(FLOW_MODEL))
    try:
        from model_def import inputs

        with torch.no_grad():
            direct = trial.model(inputs())
    finally:
        sys.path.remove(str(FLOW_MODEL))
    assert torch.allclose(torch.tensor(outputs), direct, atol=1e-6)


def test_bad_override_fails_before_training(stack):
    from flows.experiment import experiment

    before = len(mlflow().search_experiments())
    with pytest.raises(ConfigError, match=r"unknown field `searcher\.max_lenght`"):
        experiment(str(FLOW_MODEL / "grid.yaml"), ["searcher.max_lenght.batches=5"])
    assert len(mlflow().search_experiments()) == before
