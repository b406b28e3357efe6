"""A checkpoint is recorded only once the metrics reported before it are stored: a worker
lost right after the record would otherwise take the unsent points with it, and the
worker resuming from that checkpoint never reports them again (bench/hosts.py saw batches
24-30 go missing that way). Against a fake MLflow whose metric writes are held back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from registry.checkpoints import store as checkpoints
from registry.checkpoints.store import S3CheckpointStore, checkpoint_records
from registry.metrics.sink import MlflowMetricsSink
from registry.servers.s3 import S3Location
from tests.unit.test_run_lease import FakeRun


class SlowMetricsRun(FakeRun):
    """A run whose metric writes wait until ``release`` is set; it notes, at each
    checkpoint record, which training steps were stored by then."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.stored_at_record: list[int] = []

    def log_batch(self, run_id: str, metrics=(), tags=()):  # type: ignore[no-untyped-def]
        if metrics:
            self.release.wait(30)
        super().log_batch(run_id, metrics, tags)
        if tags:
            self.stored_at_record = [step for _, _, step in self.logged]


def test_the_record_waits_for_the_metrics_reported_before_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoints, "upload_dir", lambda s3, local, loc, last: None)
    run = SlowMetricsRun()
    sink = MlflowMetricsSink(run, "r", spill_dir=tmp_path / "spill", close_timeout_s=10)  # type: ignore[arg-type]
    store = S3CheckpointStore(
        run, None, "r", artifacts_destination=None, cache_dir=tmp_path, metrics=sink
    )
    monkeypatch.setattr(store, "location", lambda uuid: S3Location("b", f"ck/{uuid}"))
    for step in range(1, 31):
        sink.report_training(step, {"loss": float(step)})
    staged = store.stage()
    (staged / "state.pt").write_bytes(b"weights")
    uuid = store.publish(staged, {"steps_completed": 30})
    sink.report_training(31, {"loss": 31.0})  # after the checkpoint: need not go first
    threading.Timer(0.5, run.release.set).start()
    assert store.completed_uploads(wait=True) == [uuid]
    assert [r["steps_completed"] for r in checkpoint_records(run, "r")] == [30]  # type: ignore[arg-type]
    assert set(range(1, 31)) <= set(run.stored_at_record)
    store.close()
    sink.close()


def test_a_mark_is_settled_once_the_reports_before_it_are_stored(tmp_path: Path) -> None:
    run = SlowMetricsRun()
    sink = MlflowMetricsSink(run, "r", spill_dir=tmp_path, close_timeout_s=10)  # type: ignore[arg-type]
    sink.report_training(1, {"loss": 1.0})
    mark = sink.mark()
    assert not sink.wait_sent(mark, 0.3)  # held back by the server
    run.release.set()
    assert sink.wait_sent(mark, 10)
    assert [step for _, _, step in run.logged] == [1]
    sink.close()
