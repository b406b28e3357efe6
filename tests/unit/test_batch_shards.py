"""Batch inference's shards without servers or Prefect: a checkpoint of y = 2x + 1 over
map-style and iterable datasets from the checkpoint's code; known answers, every record once
across shards, an existing shard skipped, bad specs refused before any shard runs."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cluster.batch_shards import run_shard
from det_tasks.errors import ConfigError
from det_tasks.runner.in_process import run_trial
from flows.batch_inference import plan_shards

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "batch_model"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    ckpt = tmp_path_factory.mktemp("affine")
    result = run_trial(MODEL / "const.yaml", checkpoint_dir=ckpt, progress=False)
    assert result.checkpoint_uri
    return result.checkpoint_uri


def predictions(out: Path) -> dict[int, float]:
    rows: dict[int, float] = {}
    for f in sorted(out.glob("shard-*.parquet")):
        table = pq.read_table(f).to_pydict()
        for i, output in zip(table["index"], table["output"], strict=True):
            assert i not in rows  # every record exactly once across shards
            rows[i] = output[0]
    return rows


@pytest.mark.parametrize(
    "dataset", ["model_def:numbers", "model_def:stream", "model_def:sharded_stream"]
)
def test_every_record_once_with_its_closed_form_output(checkpoint, tmp_path, monkeypatch, dataset):
    monkeypatch.setenv("BATCH_MODEL_RECORDS", "103")
    requests = plan_shards(checkpoint, dataset, 3, tmp_path.as_uri(), 10)
    results = [run_shard(r) for r in requests]
    assert sum(r["rows"] for r in results) == 103
    rows = predictions(tmp_path)
    assert sorted(rows) == list(range(103))
    assert all(rows[i] == pytest.approx(2 * i / 1000 + 1, abs=1e-6) for i in rows)


def test_map_style_shards_are_contiguous_and_an_existing_shard_is_skipped(
    checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_MODEL_RECORDS", "20")
    requests = plan_shards(checkpoint, "model_def:numbers", 2, tmp_path.as_uri(), 4)
    first = run_shard(requests[1])
    assert pq.read_table(tmp_path / "shard-00001-of-00002.parquet").column(
        "index"
    ).to_pylist() == list(range(10, 20))
    again = run_shard(requests[1])
    assert (first["skipped"], again["skipped"], again["rows"]) == (False, True, 0)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "message"),
    [
        ("model_def", {}, "neither `module:function`"),
        ("nomodule:numbers", {}, "no module 'nomodule'"),
        ("model_def:missing", {}, "has no function 'missing'"),
        ("model_def:not_a_dataset", {}, "returned dict"),
        ("model_def:numbers", {"columns": ["x"]}, "Parquet datasets"),
        ("s3://bucket/data.csv", {"columns": ["x"]}, r"\*\.parquet"),
        ("s3://bucket/in/*.parquet", {}, "needs `columns`"),
    ],
)
def test_bad_dataset_specs_are_refused_before_any_shard(
    checkpoint, tmp_path, dataset, kwargs, message
):
    with pytest.raises(ConfigError, match=message):
        plan_shards(checkpoint, dataset, 2, tmp_path.as_uri(), 4, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_not_signed_here_does_not_run_its_dataset_code(checkpoint, tmp_path):
    import json
    import shutil

    from det_tasks.errors import CheckpointError

    foreign = tmp_path / "foreign"
    shutil.copytree(checkpoint, foreign)
    meta = json.loads((foreign / "metadata.json").read_text())
    meta["signature"] = "0" * 64
    (foreign / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not written by this installation"):
        plan_shards(str(foreign), "model_def:numbers", 2, (tmp_path / "out").as_uri(), 4)
    assert not (tmp_path / "out").exists()
