"""Determined batch-inference scripts (``determined.pytorch.experimental``) launched the way
Determined launched them (``python3 -m determined.launch.torch_distributed``, 2 slots):
records split across ranks as Determined deals them, every record exactly once across a
SIGKILL mid-job, a resume that skips finished batches (counted), and, on the real stack,
``det-tasks job run`` with ``upload_path()`` files in S3 and metrics/lineage in MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.integration.helpers import env_without_platform

BATCH_JOB = Path(__file__).resolve().parents[1] / "fixtures" / "batch_job"
RECORDS, BATCH = 50, 4  # 13 batches: rank 0 gets global batches 0, 2, ..., 12; rank 1 the odd


def calls(log: Path) -> list[tuple[int, int]]:
    return sorted(tuple(map(int, line.split())) for line in log.read_text().splitlines())


def rank_of_record(i: int) -> int:
    return (i // BATCH) % 2


def check_rows_by_rank(files: dict[str, bytes]) -> None:
    """Every record once, y = 2x + 1, on the rank Determined's sampler deals it to."""
    seen = []
    for name, body in files.items():
        rank = int(name.split("rank_")[1].split("/")[0])
        for i, y in json.loads(body):
            assert y == 2 * i + 1 and rank_of_record(i) == rank
            seen.append(i)
    assert sorted(seen) == list(range(RECORDS))


@pytest.mark.distributed
def test_two_slots_split_the_records_and_a_sigkill_resumes_without_redoing_batches(tmp_path):
    env = env_without_platform(
        DET_TASKS_HOME=str(tmp_path / "home"),
        DET_TASKS_JOB_ID="job-7",
        BATCH_CALLS_LOG=str(tmp_path / "calls"),
    )
    command = [
        sys.executable, "-m", "det_tasks.runner.cli", "run", "distributed.yaml",
        "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    killed = subprocess.run(
        command, cwd=BATCH_JOB, env={**env, "BATCH_KILL_AT": "1:3"}, capture_output=True
    )
    assert killed.returncode != 0
    # Rank 1 died at its batch 3: only the progress checkpoint after 2 batches per rank holds.
    first = calls(tmp_path / "calls")
    assert (1, 3) not in first and {(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)} <= set(first)
    (tmp_path / "calls").unlink()
    done = subprocess.run(command, cwd=BATCH_JOB, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # The resume starts at batch 2 on both ranks; rank 1 has no 7th batch (13 in all).
    assert calls(tmp_path / "calls") == [(0, b) for b in range(2, 7)] + [
        (1, b) for b in range(2, 6)
    ]
    job = tmp_path / "home" / "jobs" / "job-7"
    outputs = {p.relative_to(job).as_posix(): p.read_bytes() for p in job.glob("outputs/*/*/*")}
    assert len({name.split("/")[1] for name in outputs}) == 1  # one output uuid across attempts
    check_rows_by_rank(outputs)
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    # Reducers count what this attempt processed (as in Determined: they are not
    # checkpointed): 50 records minus the 2 x 2 batches of 4 before the progress checkpoint.
    assert {"group": "validation", "steps_completed": 7, "metrics": {"records": 34}} in metrics


@pytest.mark.slow  # two torchrun attempts through a deployment: minutes on a shared 2-core VM
def test_job_run_on_the_stack_uploads_to_s3_reports_to_mlflow_and_survives_a_sigkill(
    stack, tmp_path, capsys
):
    from det_tasks.runner.cli import main as det_tasks
    from infra.stack import deploy
    from registry.jobs.batch_jobs import JOB_TAG
    from registry.runs.tracking import client_for

    deploy(stack)
    config = tmp_path / "job.yaml"
    config.write_text(
        (BATCH_JOB / "job.yaml").read_text()
        + f"  kill_at: '1:3'\n  kill_marker: {tmp_path / 'killed'}\n"
        + f"  calls_log: {tmp_path / 'calls'}\n"
    )
    assert det_tasks(["job", "run", str(config), str(BATCH_JOB), "--follow"]) == 0
    out = capsys.readouterr().out
    job_id = next(line for line in out.splitlines() if line.startswith("Created job")).split()[-1]
    assert (tmp_path / "killed").exists()  # the first attempt was SIGKILLed; max_restarts: 1
    # Batches 0-1 of each rank were checkpointed before rank 1 died at its batch 3: the retry
    # (same job, same MLflow run) did not process them again.
    assert [c for c in calls(tmp_path / "calls") if c[1] < 2] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {c for c in calls(tmp_path / "calls") if c[1] >= 2} == {
        *((0, b) for b in range(2, 7)),
        *((1, b) for b in range(2, 6)),
    }
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    listing = s3.list_objects_v2(Bucket="det-tasks", Prefix=f"jobs/{job_id}/")["Contents"]
    files = {
        o["Key"].removeprefix(f"jobs/{job_id}/"): s3.get_object(Bucket="det-tasks", Key=o["Key"])[
            "Body"
        ].read()
        for o in listing
        if "/rank_" in o["Key"]
    }
    assert {k.split("/")[1] for k in files} == {"rank_0", "rank_1"}
    check_rows_by_rank(files)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("batch-job-test")
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'"
    )
    assert run.data.tags["det.uses_checkpoint"] == "models:/linear@champion"
    assert run.data.metrics["validation/records"] == 50 - 16  # this attempt's records
    assert run.info.status == "FINISHED"
    rows = client.get_metric_history(run.info.run_id, "inference/rows")
    # The resumed attempt reports its 34 records; the killed attempt's reports arrive only
    # if its metrics thread sent them before the SIGKILL.
    assert 34 <= sum(m.value for m in rows) <= 50


def test_parquet_on_s3_is_read_by_shard_with_its_ids_and_a_missing_column_is_refused(
    stack, tmp_path
):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster.batch_shards import run_shard
    from det_tasks.errors import ConfigError
    from det_tasks.runner.in_process import run_trial
    from flows.batch_inference import plan_shards

    model = BATCH_JOB.parent / "batch_model"
    ckpt = run_trial(model / "const.yaml", checkpoint_dir=tmp_path / "ckpt", progress=False)
    s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])
    prefix = f"inputs-{tmp_path.name}"
    for part, first in enumerate((0, 25)):  # two files, row groups of 10 rows
        ids = list(range(first, first + 25))
        table = pa.table({"rid": [f"r{i}" for i in ids], "x": [i / 1000 for i in ids], "y": ids})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=10)
        s3.put_object(
            Bucket="det-tasks", Key=f"{prefix}/part-{part}.parquet", Body=buffer.getvalue()
        )
    uri = f"s3://det-tasks/{prefix}/*.parquet"
    out = tmp_path / "out"
    requests = plan_shards(ckpt.checkpoint_uri, uri, 3, out.as_uri(), 4, ["x"], "rid")
    assert sum(len(r.row_groups) for r in requests) == 6  # 3 row groups per file, each once
    assert sum(run_shard(r)["rows"] for r in requests) == 50
    rows = {}
    for f in sorted(out.glob("shard-*.parquet")):
        table = pq.read_table(f).to_pydict()
        for rid, output in zip(table["index"], table["output"], strict=True):
            assert rid not in rows
            rows[rid] = output[0]
    assert sorted(rows) == sorted(f"r{i}" for i in range(50))
    assert all(rows[f"r{i}"] == pytest.approx(2 * i / 1000 + 1, abs=1e-6) for i in range(50))
    with pytest.raises(ConfigError, match=r"no column\(s\) \['pixels'\].*columns are"):
        plan_shards(ckpt.checkpoint_uri, uri, 3, (tmp_path / "o2").as_uri(), 4, ["pixels"])
    with pytest.raises(ConfigError, match="matches no object"):
        plan_shards(
            ckpt.checkpoint_uri, "s3://det-tasks/nothing/*.parquet", 2, out.as_uri(), 4, ["x"]
        )
    assert not (tmp_path / "o2").exists()
