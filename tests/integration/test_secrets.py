"""No secret leaves where it was put: known secrets planted in the environment and in the
model directory (.env, a .pem) appear nowhere the system wrote: the run's output, MLflow
params, tags and metric names, every object in S3 (checkpoints with their code/ copy and
load_data.json, TensorBoard files), the local cache, and the services' logs."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from infra.stack import BUCKET, StackConfig
from tests.integration.helpers import FLOW_MODEL, run_xor_trial


def test_planted_secrets_appear_nowhere(stack: StackConfig, tmp_path: Path) -> None:
    from registry.runs.tracking import client_for
    from registry.servers import s3 as s3_lib

    planted = {
        "DATABASE_URL": "postgresql://det:planted-db-password-7f3a@db/mlflow",
        "PREFECT_API_KEY": "planted-prefect-key-91c2",
        "MLFLOW_TRACKING_TOKEN_UNUSED": "planted-mlflow-token-55d1",
        "DET_TASKS_SIGNING_KEY": "planted-signing-key-0b8e",
    }
    file_secrets = {
        ".env": "API_TOKEN=planted-dotenv-token-c4e9\n",
        "client.pem": "planted-pem-e1d7",
    }
    model = tmp_path / "model"
    shutil.copytree(FLOW_MODEL, model)
    for name, text in file_secrets.items():
        (model / name).write_text(text)
    secrets = [
        "planted-db-password-7f3a",
        "planted-prefect-key-91c2",
        "planted-mlflow-token-55d1",
        "planted-signing-key-0b8e",
        "planted-dotenv-token-c4e9",
        "planted-pem-e1d7",
        os.environ["AWS_SECRET_ACCESS_KEY"],  # the stack's real S3 secret
    ]
    name = f"secrets-{uuid.uuid4().hex[:8]}"
    cache = tmp_path / "cache"
    proc = run_xor_trial(
        name, 60, {**os.environ, **planted, "DET_TASKS_CACHE_DIR": str(cache)}, model
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    written: dict[str, bytes] = {"stdout": proc.stdout.encode(), "stderr": proc.stderr.encode()}
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2  # the experiment run and its trial
    for run in runs:
        written[f"mlflow run {run.info.run_id}"] = repr(
            (run.data.params, run.data.tags, sorted(run.data.metrics))
        ).encode()
    s3 = s3_lib.client()
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys += [o["Key"] for o in page.get("Contents", []) if experiment.experiment_id in o["Key"]]
    checkpoint_objects = [k for k in keys if "/checkpoints/" in k]
    assert any(k.endswith("/code/model_def.py") for k in checkpoint_objects)
    assert any(k.endswith("/load_data.json") for k in checkpoint_objects)
    assert not any(k.endswith(("/code/.env", "/code/client.pem")) for k in checkpoint_objects)
    for key in keys:
        written[f"s3://{BUCKET}/{key}"] = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    for root in (cache, stack.root):
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in ("", ".log", ".json", ".txt", ".yaml", ".py"):
                if path.name in ("env", "s3-identities.json"):
                    continue  # where the stack keeps its own keys, by design
                written[str(path)] = path.read_bytes()

    leaks = [
        f"{secret[:12]}... in {where}"
        for where, data in written.items()
        for secret in secrets
        if secret.encode() in data
    ]
    assert not leaks, "\n".join(leaks)
    assert len(written) > 10  # the search did look at what was written
