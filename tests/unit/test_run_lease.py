"""Fencing a trial run (registry.runs.run_lease) against a fake MLflow client: the newest
opener holds the run; an older one, back from a partition, sends only the metric points up
to the newest checkpoint recorded when it learned it, records no checkpoint (and removes
its copy's files), and cannot take the run back by a stale tag."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from registry.checkpoints import store as checkpoints
from registry.checkpoints.store import CHECKPOINT_TAG, S3CheckpointStore, checkpoint_records
from registry.metrics.sink import MlflowMetricsSink
from registry.runs.run_lease import HOLDER_TAG, RunLease
from registry.servers.s3 import S3Location


class FakeRun:
    """The MlflowClient calls a lease, the metrics sink and the checkpoint store make on
    one run, over a local (non-HTTP) store."""

    tracking_uri = "sqlite:///unused.db"

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.logged: list[tuple[str, float, int]] = []

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags[key] = value

    def get_run(self, run_id: str) -> Any:
        latest = {key: 0.0 for key, _, _ in self.logged}
        return SimpleNamespace(data=SimpleNamespace(tags=dict(self.tags), metrics=latest))

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return [SimpleNamespace(step=s, timestamp=0) for k, _, s in self.logged if k == key]

    def log_batch(self, run_id: str, metrics: list[Any] = (), tags: list[Any] = ()) -> None:  # type: ignore[assignment]
        self.logged += [(m.key, m.value, m.step) for m in metrics]
        self.tags.update({t.key: t.value for t in tags})


def _record(run: FakeRun, steps: int) -> None:
    run.tags[f"{CHECKPOINT_TAG}ck-{steps}"] = json.dumps(
        {"uuid": f"ck-{steps}", "steps_completed": steps}
    )


def test_the_newest_opener_holds_the_run_and_an_older_one_stays_fenced() -> None:
    run = FakeRun()
    first, second = RunLease(run, "r"), RunLease(run, "r")
    first.take()
    assert first.held() and run.tags[HOLDER_TAG] == first.token
    second.take()
    assert second.held() and not first.held()
    assert first.lost_to == second.token
    first.take()  # a stale tag written back does not make it the holder again
    assert not first.held()


def test_a_fenced_sink_sends_only_points_up_to_its_own_newest_checkpoint(tmp_path: Path) -> None:
    run = FakeRun()
    lease = RunLease(run, "r")
    lease.take()
    sink = MlflowMetricsSink(run, "r", spill_dir=tmp_path, close_timeout_s=10, lease=lease)  # type: ignore[arg-type]
    for step in range(1, 11):
        sink.report_training(step, {"loss": float(step)})
    assert sink.flush(10)
    # Its checkpoint at 12 recorded, then cut off: it trains on to 20 in the dark, unsent.
    lease.recorded(12)
    for step in range(11, 21):
        sink.report_training(step, {"loss": float(step)})
    # Another worker takes the run from that checkpoint (12) and, training on, records
    # newer ones (24): those do not let the cut-off one's 13-20 through.
    RunLease(run, "r").take()
    _record(run, 24)
    sink.close()
    assert [step for _, _, step in run.logged] == list(range(1, 13))


def test_a_fenced_sink_that_recorded_no_checkpoint_sends_nothing_more(tmp_path: Path) -> None:
    run = FakeRun()
    lease = RunLease(run, "r")
    lease.take()
    sink = MlflowMetricsSink(run, "r", spill_dir=tmp_path, close_timeout_s=10, lease=lease)  # type: ignore[arg-type]
    sink.report_validation(0, {"loss": 1.0})  # the initial validation, which a new holder repeats
    RunLease(run, "r").take()
    sink.close()
    assert run.logged == []


def test_a_fenced_store_records_no_checkpoint_and_removes_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploaded: list[str] = []
    removed: list[str] = []
    monkeypatch.setattr(
        checkpoints, "upload_dir", lambda s3, local, loc, last: uploaded.append(loc.uri)
    )
    monkeypatch.setattr(checkpoints, "delete_prefix", lambda s3, loc: removed.append(loc.uri) or 0)
    run = FakeRun()
    lease = RunLease(run, "r")
    lease.take()
    store = S3CheckpointStore(
        run, None, "r", artifacts_destination=None, cache_dir=tmp_path, lease=lease
    )
    location = S3Location("bucket", "runs/r/checkpoints")

    def upload(uuid: str) -> None:
        staged = tmp_path / uuid
        staged.mkdir()
        (staged / "state.pt").write_bytes(b"weights")
        store._upload(staged, {"steps_completed": 30}, location.child(uuid), uuid)

    upload("held")
    assert lease.recorded_through == 30
    RunLease(run, "r").take()
    upload("fenced")
    assert [r["uuid"] for r in checkpoint_records(run, "r")] == ["held"]  # type: ignore[arg-type]
    assert uploaded == [location.child("held").uri, location.child("fenced").uri]
    assert removed == [location.child("fenced").uri] and not (tmp_path / "fenced").exists()
    store.close()
