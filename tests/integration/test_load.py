"""Load (``make test-slow``): many trials at once against one local stack, and metrics at a
high rate. Each test prints the figures it measures; what it asserts is that nothing is
lost, duplicated or failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import boto3
import pytest

from det_tasks import pytorch
from det_tasks.sinks import InMemoryMetricsSink
from infra.stack import down, up
from registry.checkpoints.models import trial_runs
from registry.checkpoints.store import checkpoint_records
from registry.jobs.trial_services import trial_services
from registry.runs.tracking import client_for
from tests.fixtures.trials import OneVarTrial
from tests.integration.helpers import env_without_platform, isolated_stack_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

METRICS = 50
BATCHES = 5000
PG_STACK_OFFSET = 200  # the PostgreSQL stack's ports, beside the session stack's


class FiftyMetricsTrial(OneVarTrial):
    """OneVarTrial reporting 50 metrics every batch: m<i> = i * loss."""

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        loss = super().train_batch(batch, epoch_idx, batch_idx)["loss"]
        return {"loss": loss, **{f"m{i:02d}": loss * i for i in range(1, METRICS)}}


CONFIG = {
    "name": "load-metrics",
    "entrypoint": "trials:OneVarTrial",
    "hyperparameters": {"global_batch_size": 4, "learning_rate": 0.001},
    "searcher": {"name": "single", "metric": "val_loss", "max_length": {"batches": BATCHES}},
}


def _fit(sink: Any, store: Any) -> float:
    ctx = pytorch.init(
        hparams=CONFIG["hyperparameters"],
        exp_conf=CONFIG,
        metrics_sink=sink,
        checkpoint_store=store,
    )
    trial = FiftyMetricsTrial(ctx)
    started = time.perf_counter()
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(BATCHES),
        reporting_period=pytorch.Batch(1),
        validation_period=pytorch.Batch(BATCHES),
        checkpoint_policy="none",
    )
    return time.perf_counter() - started


def test_fifty_metrics_every_batch_all_arrive(stack: Any, model_dir: Path, tmp_path: Path) -> None:
    from det_tasks.checkpoints.store import LocalDirectoryStore

    baseline_s = _fit(InMemoryMetricsSink(), LocalDirectoryStore(tmp_path / "ckpt"))
    with trial_services(
        CONFIG, CONFIG["hyperparameters"], model_dir=model_dir, experiment_name="load-metrics"
    ) as svc:
        run_id = svc.metrics_sink.run_id
        logged_s = _fit(svc.metrics_sink, svc.checkpoint_store)
        closing = time.perf_counter()
    drain_s = time.perf_counter() - closing
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "training/loss")}
    assert sorted(losses) == list(range(1, BATCHES + 1))
    for i in range(1, METRICS):
        history = client.get_metric_history(run_id, f"training/m{i:02d}")
        steps = [m.step for m in history]
        assert len(steps) == BATCHES and sorted(steps) == list(range(1, BATCHES + 1)), i
        for m in history[:: BATCHES // 10]:
            assert m.value == pytest.approx(i * losses[m.step], rel=1e-5)
    print(
        f"\n{METRICS} metrics x {BATCHES} batches = {METRICS * BATCHES} points, all stored once; "
        f"step time with MLflow {1000 * logged_s / BATCHES:.3f} ms vs in-memory sink "
        f"{1000 * baseline_s / BATCHES:.3f} ms (ratio {logged_s / baseline_s:.2f}); "
        f"drain after training {drain_s:.1f} s"
    )


def _grid_overrides(trials: int) -> list[str]:
    """``trials`` MNIST trials (one learning rate each), all at once, one epoch each."""
    return [
        "searcher.name=grid",
        f"searcher.max_concurrent_trials={trials}",
        "searcher.max_length={epochs: 1}",
        "min_validation_period={epochs: 1}",
        "hyperparameters.learning_rate={type: categorical, vals: "
        + str([round(0.1 * (i + 1), 2) for i in range(trials)])
        + "}",
        "max_restarts=0",
    ]


def _audit(summary: dict[str, Any], env: Mapping[str, str]) -> tuple[int, list[str]]:
    """(trial runs found, every problem: a run not FINISHED, a training point duplicated or
    missing at the last step, a recorded checkpoint absent from S3)."""
    client = client_for(env["MLFLOW_TRACKING_URI"])
    parent_run_id = summary["mlflow_parent_run"].split("?")[0].rsplit("/", 1)[-1]
    runs = trial_runs(client, client.get_run(parent_run_id))
    s3 = boto3.client(
        "s3",
        endpoint_url=env["MLFLOW_S3_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    batches_per_trial = summary["best"]["batches_trained"]  # one epoch of the digits
    assert batches_per_trial > 0
    errors: list[str] = []
    for run in runs:
        if run.info.status != "FINISHED":
            errors.append(f"{run.info.run_name}: {run.info.status}")
        history = client.get_metric_history(run.info.run_id, "training/loss")
        steps = [m.step for m in history]
        if len(steps) != len(set(steps)):
            errors.append(f"{run.info.run_name}: duplicated training/loss points")
        if not steps or max(steps) != batches_per_trial:
            errors.append(f"{run.info.run_name}: training/loss steps end at {steps[-1:]}")
        records = checkpoint_records(client, run.info.run_id)
        if not records:
            errors.append(f"{run.info.run_name}: no checkpoint recorded")
        for record in records:
            bucket, _, key = record["s3_uri"][5:].partition("/")
            try:
                s3.head_object(Bucket=bucket, Key=f"{key}/metadata.json")
            except Exception as err:
                errors.append(f"{record['uri']}: missing in S3 ({err})")
    return len(runs), errors


def test_sixteen_mnist_trials_at_once(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.experiment import experiment

    # Not the stack's two Dask workers: an embedded cluster of one worker per trial, so the
    # 16 trials really train (and hit MLflow and S3) at once.
    monkeypatch.delenv("DET_TASKS_DASK_SCHEDULER")
    trials = 16
    started = time.perf_counter()
    summary = experiment(str(ROOT / "examples/mnist/const.yaml"), _grid_overrides(trials))
    wall_s = time.perf_counter() - started
    found, errors = _audit(summary, os.environ)
    print(
        f"\n{trials} MNIST trials at once (1 epoch each), SQLite: wall {wall_s:.1f} s, "
        f"{found} trial runs, errors: {len(errors)}"
    )
    assert found == trials
    assert errors == []


@pytest.fixture(scope="module")
def postgres_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if not shutil.which("initdb") and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("no PostgreSQL server binaries on this machine")
    config = isolated_stack_config(
        tmp_path_factory.mktemp("pg-stack"),
        PG_STACK_OFFSET,
        postgres_port=25432 + int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0")),
        dask_workers=0,  # its trials run on an embedded cluster of their own (below)
    )
    try:
        yield up(config)
    finally:
        down(config)


def test_thirty_two_mnist_trials_at_once_on_postgresql(
    postgres_stack: dict[str, str], tmp_path: Path
) -> None:
    trials = 32
    # No DET_TASKS_DASK_SCHEDULER: an embedded cluster of one worker per trial (32 at once).
    stack_env = {k: v for k, v in postgres_stack.items() if k != "DET_TASKS_DASK_SCHEDULER"}
    env = env_without_platform(
        **stack_env,
        PREFECT_HOME=str(tmp_path / "prefect"),
        DET_TASKS_CACHE_DIR=str(tmp_path / "cache"),
    )
    # The PostgreSQL stack's own MLflow, not the session stack's (DET_TASKS_TEST_PORT_OFFSET
    # shifts both).
    pg_mlflow_port = isolated_stack_config(tmp_path, PG_STACK_OFFSET).mlflow_port
    assert postgres_stack["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{pg_mlflow_port}"
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.experiment",
            str(ROOT / "examples/mnist/const.yaml"),
            *_grid_overrides(trials),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall_s = time.perf_counter() - started
    # Kept for a CI run's post-mortem (pytest's tmp folders outlive the run).
    (tmp_path / "flow.log").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(proc.stdout)
    found, errors = _audit(summary, postgres_stack)
    print(
        f"\n{trials} MNIST trials at once (1 epoch each), PostgreSQL behind MLflow and Prefect: "
        f"wall {wall_s:.1f} s, {found} trial runs, errors: {len(errors)}"
    )
    assert found == trials
    assert errors == []
