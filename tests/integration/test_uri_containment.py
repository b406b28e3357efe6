"""Against the real stack (MLflow server, SeaweedFS S3): `det-tasks download` of a runs:/ URI
that climbs out of the run's artifacts to a complete checkpoint stored elsewhere in the
bucket is refused in one line and makes nothing, while the same checkpoint by its own URI
downloads."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from det_tasks import pytorch
from det_tasks.runner.cli import main
from registry.checkpoints.store import checkpoint_records
from registry.jobs.trial_services import trial_services
from registry.runs.tracking import client_for
from registry.servers import s3 as s3_lib
from tests.fixtures.trials import OneVarTrial
from tests.integration.test_registry import CONFIG


def det_tasks(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *args],
        cwd=cwd,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def logged_checkpoint(stack, model_dir) -> tuple[str, dict]:
    """A trial run with one checkpoint in S3: (run id, its checkpoint record)."""
    with trial_services(
        CONFIG,
        CONFIG["hyperparameters"],
        model_dir=model_dir,
        experiment_name=f"contain-{uuid.uuid4().hex[:8]}",
    ) as svc:
        run_id = svc.metrics_sink.run_id
        ctx = pytorch.init(
            hparams=CONFIG["hyperparameters"],
            exp_conf=CONFIG,
            metrics_sink=svc.metrics_sink,
            checkpoint_store=svc.checkpoint_store,
        )
        pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
            max_length=pytorch.Batch(2), checkpoint_policy="none"
        )
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    [record] = checkpoint_records(client, run_id)
    return run_id, record


def test_download_of_a_traversal_is_refused_and_makes_nothing(
    logged_checkpoint, tmp_path, monkeypatch, capsys
):
    run_id, record = logged_checkpoint
    source = s3_lib.parse_s3_uri(record["s3_uri"])  # .../<run>/artifacts/checkpoints/<uuid>
    # A complete checkpoint outside the run's artifacts: what a traversal would reach.
    outside = f"outside-{uuid.uuid4().hex[:8]}"
    run_root = source.prefix.rsplit("/", 3)[0]  # .../<experiment>/<run>
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    for key in s3_lib.list_keys(s3, source):
        s3.copy_object(
            Bucket=source.bucket,
            Key=f"{run_root}/{outside}/{key[len(source.prefix) + 1 :]}",
            CopySource={"Bucket": source.bucket, "Key": key},
        )
    cache = Path(os.environ["DET_TASKS_CACHE_DIR"]) / "checkpoints"
    cached_before = sorted(cache.glob("*")) if cache.exists() else []

    traversal = f"runs:/{run_id}/checkpoints/../../{outside}"
    refused = det_tasks(tmp_path, "download", traversal, "dl10/../dl11")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"error: {traversal!r} leaves the run's artifact root (s3://")
    assert refused.stderr.count("\n") == 1 and ".py:" not in refused.stderr
    assert list(tmp_path.iterdir()) == []  # neither dl10 nor dl11
    assert (sorted(cache.glob("*")) if cache.exists() else []) == cached_before

    # The same in this process (a second interpreter start costs seconds): encoded, and the
    # checkpoint's own URI, which downloads to the normalised destination only.
    monkeypatch.chdir(tmp_path)
    encoded = f"runs:/{run_id}/checkpoints/%2e%2e/%2e%2e/{outside}"
    assert main(["download", encoded, "dl10/../dl11"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {encoded!r} leaves the run's artifact root")
    assert list(tmp_path.iterdir()) == []
    assert main(["download", record["uri"], "dl10/../dl11"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl11"]
    assert (tmp_path / "dl11" / "metadata.json").is_file()
