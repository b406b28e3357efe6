"""A config of any size runs to the end on the stack (MLflow server + SeaweedFS): a
9,000-character description and a 30 KB categorical list. The parent run used to keep the
config's JSON cut at 7,900 characters, and every checkpoint GC then failed to parse it
("Unterminated string"), failing the experiment after training."""

from __future__ import annotations

import json
import os
import random
import shutil
import string
from pathlib import Path

import boto3
import yaml

from det_tasks.runner.trial_setup import load_raw_config
from registry.checkpoints.models import trial_runs
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import EXPERIMENT_RUN_TAG, client_for, experiment_config

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"


def _letters(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(string.ascii_letters) for _ in range(length))


def _large_config(folder: Path, rng: random.Random) -> tuple[Path, list[str]]:
    words = [_letters(rng, 16) for _ in range(1_800)]
    config = {
        "name": "large-config",
        "entrypoint": "model_def:XorTrial",
        "hyperparameters": {
            "global_batch_size": 8,
            "learning_rate": 0.1,
            "hidden": 6,
            "word": {"type": "categorical", "vals": words},
        },
        "searcher": {
            "name": "random",
            "metric": "validation_loss",
            "max_trials": 1,
            "max_length": {"batches": 8},
        },
        "min_checkpoint_period": {"batches": 2},  # checkpoints at batches 2, 4, 6 and 8
        "checkpoint_storage": {
            "type": "s3",
            "bucket": "det-tasks",
            "save_trial_latest": 2,
            "save_trial_best": 0,
        },
        "reproducibility": {"experiment_seed": 3},
    }
    shutil.copy(FLOW_MODEL / "model_def.py", folder / "model_def.py")
    path = folder / "large.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path, words


def test_a_30_kb_config_runs_to_the_end_with_its_checkpoints_collected(stack, tmp_path):
    from flows.experiment import experiment

    rng = random.Random(7)
    path, words = _large_config(tmp_path, rng)
    description = _letters(rng, 9_000)
    overrides = [f"description={description}"]
    raw, _ = load_raw_config(path, overrides)
    assert len(json.dumps(raw)) > 30_000

    summary = experiment(str(path), overrides)

    assert summary["best"]["batches_trained"] == 8
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    found = client.get_experiment_by_name("large-config")
    (parent,) = client.search_runs(
        [found.experiment_id], filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` != ''"
    )
    (trial,) = trial_runs(client, parent)
    assert (parent.info.status, parent.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    assert (trial.info.status, trial.data.tags["det.state"]) == ("FINISHED", "COMPLETED")
    # The config comes back whole, and no tag is past MLflow's limit.
    config = experiment_config(parent.data.tags)
    assert config == raw
    assert config["description"] == description
    assert config["hyperparameters"]["word"]["vals"] == words
    assert all(len(v) <= 8_000 for v in parent.data.tags.values())
    # GC by policy: the latest two of the four checkpoints stay (none kept as best), in
    # MLflow and in S3; the other two are gone from both.
    records = checkpoint_records(client, trial.info.run_id)
    assert [r["steps_completed"] for r in records] == [6, 8]
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    bucket, _, key = records[0]["s3_uri"][len("s3://") :].partition("/")
    checkpoints = key.rsplit("/", 1)[0]
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{checkpoints}/").get("Contents", [])
    stored = {item["Key"][len(checkpoints) + 1 :].split("/")[0] for item in listed}
    assert stored == {r["uuid"] for r in records}
