"""MLflow + S3 registry against the real local stack: logged params/metrics/checkpoints,
an MLflow outage mid-training, GC, the model registry round trip, and clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from det_tasks import CheckpointError, pytorch
from det_tasks.pytorch import PyTorchCallback
from infra import services
from registry.checkpoints.models import best_checkpoint, register_checkpoint
from registry.checkpoints.store import checkpoint_records
from registry.jobs.trial_services import trial_services
from registry.runs.tracking import client_for
from registry.servers import s3 as s3_lib
from tests.fixtures.trials import OneVarTrial

CONFIG = {
    "name": "registry-test",
    "entrypoint": "trials:OneVarTrial",
    "hyperparameters": {"global_batch_size": 4, "learning_rate": 0.1},
    "searcher": {
        "name": "single",
        "metric": "val_loss",
        "smaller_is_better": True,
        "max_length": {"batches": 40},
    },
    "checkpoint_storage": {
        "type": "s3",
        "bucket": "det-tasks",
        "save_trial_latest": 1,
        "save_trial_best": 1,
        "save_experiment_best": 0,
    },
}


def train(services_, batches=40, callbacks=None, trial_cls=OneVarTrial, **fit):
    ctx = pytorch.init(
        hparams=CONFIG["hyperparameters"],
        exp_conf=CONFIG,
        metrics_sink=services_.metrics_sink,
        checkpoint_store=services_.checkpoint_store,
    )
    trial = trial_cls(ctx)
    if callbacks:
        trial.build_callbacks = lambda: callbacks
    fit.setdefault("reporting_period", pytorch.Batch(1))
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(batches), **fit)
    return trial, result


def experiment_name() -> str:
    return f"exp-{uuid.uuid4().hex[:8]}"


def test_trial_logs_params_metrics_and_checkpoint_bytes(stack, model_dir):
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    name = experiment_name()
    with trial_services(
        CONFIG, CONFIG["hyperparameters"], model_dir=model_dir, experiment_name=name, seed=3
    ) as svc:
        run_id = svc.metrics_sink.run_id
        _, result = train(svc, validation_period=pytorch.Batch(10), checkpoint_policy="all")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["hp.learning_rate"] == "0.1"
    assert run.data.params["searcher.metric"] == "val_loss"
    assert run.data.tags["det.seed"] == "3" and len(run.data.tags["det.code_version"]) == 12
    losses = client.get_metric_history(run_id, "training/loss")
    assert [m.step for m in losses] == list(range(1, 41))
    w = 0.0
    for m in losses:  # the closed form, through MLflow
        assert m.value == pytest.approx((1 - w) ** 2, abs=1e-6)
        w = w + 0.2 * (1 - w)
    assert [m.step for m in client.get_metric_history(run_id, "validation/val_loss")] == [
        10,
        20,
        30,
        40,
    ]
    assert [m.value for m in client.get_metric_history(run_id, "progress/epochs")][-1] == 2.5
    # Retention (latest 1 + best 1) left exactly the step-40 checkpoint; its bytes are in S3.
    records = checkpoint_records(client, run_id)
    assert [r["steps_completed"] for r in records] == [40]
    assert result.checkpoint_uri == records[0]["uri"]
    location = s3_lib.parse_s3_uri(records[0]["s3_uri"])
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    metadata = json.loads(
        s3.get_object(Bucket=location.bucket, Key=location.key("metadata.json"))["Body"].read()
    )
    body = s3.get_object(Bucket=location.bucket, Key=location.key("state_dict.pth"))["Body"].read()
    assert hashlib.sha256(body).hexdigest() == metadata["files"]["state_dict.pth"]["sha256"]
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert any(a.path == "learning_curves.png" for a in client.list_artifacts(parent.info.run_id))
    assert any(a.path == "checkpoints" for a in client.list_artifacts(run_id))


def test_mlflow_outage_loses_and_duplicates_nothing(stack, model_dir, mlflow_server):
    class Outage(PyTorchCallback):
        def on_training_workload_end(self, avg_metrics, batch_metrics):
            step = len(self.seen) + 1
            self.seen.append(step)
            if step == 10:
                services.stop(mlflow_server)
                self.was_down = not mlflow_server.healthy()
            if step == 45:
                services.start(mlflow_server)

    outage = Outage()
    outage.seen = []
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    with trial_services(
        CONFIG, CONFIG["hyperparameters"], model_dir=model_dir, experiment_name=experiment_name()
    ) as svc:
        run_id = svc.metrics_sink.run_id
        train(svc, batches=60, callbacks={"outage": outage}, checkpoint_policy="none")
        assert outage.was_down  # reports 10..45 were made while the server was down
    steps = [m.step for m in client.get_metric_history(run_id, "training/loss")]
    assert steps == list(range(1, 61))


def test_gc_keeps_policy_and_registered_versions(stack, model_dir):
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    name = experiment_name()
    key = uuid.uuid4().hex
    run_ids = []
    for trial_id, lr in (("1", 0.1), ("2", 0.05)):
        hp = {**CONFIG["hyperparameters"], "learning_rate": lr}
        with trial_services(
            CONFIG,
            hp,
            model_dir=model_dir,
            experiment_name=name,
            trial_id=trial_id,
            experiment_run_key=key,
        ) as svc:
            run_ids.append(svc.metrics_sink.run_id)
            if trial_id == "2":
                # Register trial 1's first checkpoint before trial 2 ends: GC must keep it.
                first = checkpoint_records(client, run_ids[0])
                assert len(first) == 1
            ctx = pytorch.init(
                hparams=hp,
                exp_conf=CONFIG,
                metrics_sink=svc.metrics_sink,
                checkpoint_store=svc.checkpoint_store,
            )
            pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
                max_length=pytorch.Batch(30),
                validation_period=pytorch.Batch(10),
                checkpoint_policy="all",
            )
        if trial_id == "1":
            best = best_checkpoint(client, name)
            register_checkpoint(client, f"gc-{key[:6]}", best)
    kept = {rid: [r["steps_completed"] for r in checkpoint_records(client, rid)] for rid in run_ids}
    # Each trial: latest (30) is also its best (loss falls monotonically) -> one kept.
    assert kept[run_ids[1]] == [30]
    assert kept[run_ids[0]] == [30]
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    # Deleting again is harmless.
    from registry.checkpoints.gc import collect_experiment_garbage
    from registry.checkpoints.models import parent_run, trial_runs

    parent = parent_run(client, name)
    again = collect_experiment_garbage(client, s3, parent, trial_runs(client, parent))
    assert again.deleted == []


def test_register_alias_and_load_models_uri_round_trip(stack, model_dir):
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    name = experiment_name()
    with trial_services(
        CONFIG, CONFIG["hyperparameters"], model_dir=model_dir, experiment_name=name
    ) as svc:
        trial, _ = train(svc, batches=12, checkpoint_policy="best")
    best = best_checkpoint(client, name)
    model = f"m-{uuid.uuid4().hex[:6]}"
    version = register_checkpoint(client, model, best, alias="champion")
    loaded = pytorch.load_trial_from_checkpoint_path(
        f"models:/{model}@champion", trial_class=OneVarTrial
    )
    x = torch.linspace(-2, 2, 7).unsqueeze(1)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), trial.model(x))
    by_version = pytorch.load_trial_from_checkpoint_path(
        f"models:/{model}/{version}", trial_class=OneVarTrial
    )
    assert torch.equal(by_version.model.weight, trial.model.weight)
    cached = list((Path(os.environ["DET_TASKS_CACHE_DIR"]) / "checkpoints").iterdir())
    assert len([p for p in cached if not p.name.startswith(".")]) >= 1  # downloaded once


def test_clear_errors(stack, tmp_path):
    with pytest.raises(CheckpointError, match="no such model version"):
        pytorch.load_trial_from_checkpoint_path(
            "models:/does-not-exist@champion", trial_class=OneVarTrial
        )
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        pytorch.load_trial_from_checkpoint_path(
            "s3://det-tasks/no/such/checkpoint", trial_class=OneVarTrial
        )
    with pytest.raises(CheckpointError, match="has no run"):
        pytorch.load_trial_from_checkpoint_path(
            "runs:/0123456789abcdef/checkpoints/x", trial_class=OneVarTrial
        )
    wrong = {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    saved = {k: os.environ[k] for k in wrong}
    os.environ.update(wrong)
    try:
        with pytest.raises(CheckpointError, match="secret key is wrong"):
            pytorch.load_trial_from_checkpoint_path(
                "s3://det-tasks/any/checkpoint", trial_class=OneVarTrial
            )
    finally:
        os.environ.update(saved)
    with pytest.raises(CheckpointError, match="bucket does not exist"):
        pytorch.load_trial_from_checkpoint_path(
            "s3://no-such-bucket-x/ckpt", trial_class=OneVarTrial
        )
    saved_uri = os.environ["MLFLOW_TRACKING_URI"]
    os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"
    try:
        with pytest.raises(CheckpointError, match="unreachable"):
            pytorch.load_trial_from_checkpoint_path(
                "runs:/abc/checkpoints/x", trial_class=OneVarTrial
            )
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = saved_uri
    staging = Path(os.environ["DET_TASKS_CACHE_DIR"]) / "checkpoints"
    assert not any(p.name.startswith(".download-") for p in staging.glob("*"))


def test_metrics_sink_closes_once_and_promptly_after_every_point_arrived(stack, tmp_path):
    """The runner and the run services both close the sink: the second close must neither
    wait out the close timeout (it once hung 120 s per sink) nor lose a point."""
    import time

    from registry.metrics.sink import MlflowMetricsSink
    from registry.runs.tracking import client_for, ensure_experiment

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    run = client.create_run(ensure_experiment(client, "sink-close"))
    sink = MlflowMetricsSink(client, run.info.run_id, spill_dir=tmp_path, close_timeout_s=60)
    for step in range(1, 51):
        sink.report_training(step, {"loss": 1.0 / step})
    sink.close()
    started = time.monotonic()
    sink.close()
    assert sink.flush(timeout_s=60) is True
    assert time.monotonic() - started < 5.0
    history = client.get_metric_history(run.info.run_id, "training/loss")
    assert sorted(m.step for m in history) == list(range(1, 51))


def test_two_ranks_reporting_the_same_steps_to_one_run_both_keep_every_report(stack, tmp_path):
    """A batch job's ranks log to one MLflow run. A rank's sink skips steps already stored
    (a retried attempt re-reports them), but only its own: rank 1 storing step 2 first must
    not make rank 0 drop its step 2 (CI lost 8 of a job's 34 rows this way)."""
    from registry.metrics.sink import MlflowMetricsSink
    from registry.runs.tracking import client_for, ensure_experiment

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    run = client.create_run(ensure_experiment(client, "sink-two-ranks"))
    first = MlflowMetricsSink(
        client, run.info.run_id, spill_dir=tmp_path / "1", writer=(1, 2), close_timeout_s=60
    )
    for step in (0, 2, 4):
        first.report_metrics("inference", step, {"rows": 8})
    first.close()
    second = MlflowMetricsSink(
        client, run.info.run_id, spill_dir=tmp_path / "0", writer=(0, 2), close_timeout_s=60
    )
    for step in (0, 2, 4, 6):
        second.report_metrics("inference", step, {"rows": 8})
    second.close()
    history = client.get_metric_history(run.info.run_id, "inference/rows")
    assert sorted((m.timestamp % 2, m.step) for m in history) == [
        (0, 0), (0, 2), (0, 4), (0, 6), (1, 0), (1, 2), (1, 4),
    ]  # fmt: skip
    # A retried rank 0 re-reporting its stored steps sends only what is new.
    retried = MlflowMetricsSink(
        client, run.info.run_id, spill_dir=tmp_path / "r", writer=(0, 2), close_timeout_s=60
    )
    for step in (4, 6, 8):
        retried.report_metrics("inference", step, {"rows": 8})
    retried.close()
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "inference/rows")]
    assert sorted(steps) == [0, 0, 2, 2, 4, 4, 6, 8]
