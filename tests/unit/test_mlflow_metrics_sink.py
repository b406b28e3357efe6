"""The MLflow sink without a server: its retry rule against a fake client (steps its writer
already stored are not re-sent, and only keys the run already holds cost a history
request), its backlog spilled past the memory bound while the store fails, and the
log-batch body it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from registry.metrics.sink import MlflowMetricsSink


class FakeClient:
    """The few MlflowClient calls the sink makes, over a local (non-HTTP) store."""

    tracking_uri = "sqlite:///unused.db"

    def __init__(self, stored: dict[str, list[tuple[int, int]]]) -> None:
        self.stored = stored  # key -> [(step, timestamp)]
        self.calls: list[tuple[str, str | None]] = []
        self.logged: list[tuple[str, float, int]] = []

    def get_run(self, run_id: str) -> Any:
        self.calls.append(("get_run", None))
        latest = {key: 0.0 for key in self.stored}
        return SimpleNamespace(data=SimpleNamespace(metrics=latest))

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        self.calls.append(("get_metric_history", key))
        return [SimpleNamespace(step=s, timestamp=t) for s, t in self.stored.get(key, [])]

    def log_batch(self, run_id: str, metrics: list[Any]) -> None:
        self.logged += [(m.key, m.value, m.step) for m in metrics]


def test_a_retried_trial_sends_only_new_steps_and_reads_history_only_of_stored_keys(
    tmp_path: Path,
) -> None:
    client = FakeClient({"training/loss": [(1, 1000), (2, 1000), (3, 1000)]})
    sink = MlflowMetricsSink(client, "run", spill_dir=tmp_path, close_timeout_s=10)  # type: ignore[arg-type]
    for step in (2, 3, 4, 5):
        sink.report_training(step, {"loss": float(step), "acc": step / 10})
    sink.close()
    assert sorted(client.logged) == [
        ("training/acc", 0.2, 2), ("training/acc", 0.3, 3), ("training/acc", 0.4, 4),
        ("training/acc", 0.5, 5), ("training/loss", 4.0, 4), ("training/loss", 5.0, 5),
    ]  # fmt: skip
    assert client.calls == [("get_run", None), ("get_metric_history", "training/loss")]
    assert sink.sent_points == 6


def test_the_log_batch_body_is_json_dumps_text_with_protobuf_spellings_of_nan_and_inf(
    tmp_path: Path,
) -> None:
    sink = MlflowMetricsSink(FakeClient({}), "run-1", spill_dir=tmp_path)  # type: ignore[arg-type]
    finite = [
        ("training/loss", 0.1, 1764082000000, 3),
        ('odd"ké\\y', -0.0, 1, 2),
        ("a", 1e300, 5, 6),
    ]
    as_dicts = [{"key": k, "value": v, "timestamp": t, "step": s} for k, v, t, s in finite]
    assert sink._batch_json(finite) == json.dumps({"run_id": "run-1", "metrics": as_dicts})
    odd = [("x", math.nan, 1, 1), ("y", math.inf, 1, 1), ("z", -math.inf, 1, 1)]
    assert [m["value"] for m in json.loads(sink._batch_json(odd))["metrics"]] == [
        "NaN", "Infinity", "-Infinity",
    ]  # fmt: skip
    sink.close()


class FlakyClient(FakeClient):
    """A store whose first ``failures`` log_batch calls store half the batch and then fail,
    as a request cut midway does; it records every point it stores, duplicates included."""

    def __init__(self, failures: int, spill_dir: Path) -> None:
        super().__init__({})
        self.failures = failures
        self.spill_dir = spill_dir
        self.points: list[tuple[str, float, int, int]] = []
        self.spilled_files_seen = 0

    def get_run(self, run_id: str) -> Any:
        latest = {key: 0.0 for key, _, _, _ in self.points}
        return SimpleNamespace(data=SimpleNamespace(metrics=latest))

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return [
            SimpleNamespace(key=k, value=v, timestamp=t, step=s)
            for k, v, t, s in self.points
            if k == key
        ]

    def log_batch(self, run_id: str, metrics: list[Any]) -> None:
        rows = [(m.key, m.value, m.timestamp, m.step) for m in metrics]
        self.spilled_files_seen = max(
            self.spilled_files_seen, len(list(self.spill_dir.glob("*.reports")))
        )
        if self.failures:
            self.failures -= 1
            self.points += rows[: len(rows) // 2]
            raise ConnectionError("cut midway")
        self.points += rows


def _spilling_sink(
    client: FlakyClient, spill: Path, memory_limit: int, flush_interval_s: float
) -> MlflowMetricsSink:
    """A sink over ``client`` whose backlog spills to ``spill`` past ``memory_limit``."""
    return MlflowMetricsSink(
        client,  # type: ignore[arg-type]
        "run",
        spill_dir=spill,
        memory_limit=memory_limit,
        flush_interval_s=flush_interval_s,
        close_timeout_s=30,
    )


def test_a_backlog_past_the_memory_bound_spills_in_order_and_every_point_is_stored_once(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr("registry.metrics.report_backlog.CHUNK_POINTS", 20)  # 2 reports a chunk
    spill = tmp_path / "spill"
    client = FlakyClient(failures=2, spill_dir=spill)
    sink = _spilling_sink(client, spill, memory_limit=50, flush_interval_s=0.01)
    for step in range(1, 301):
        sink.report_training(step, {f"m{i}": step + i / 10 for i in range(10)})
        sink.report_training(step, {"flag": True, "note": "not a number"})  # no points
    sink.close()
    assert sorted(client.points) == sorted(set(client.points))  # none stored twice
    stored = {(k, s): v for k, v, _, s in client.points}
    assert stored == {
        (f"training/m{i}", step): step + i / 10 for step in range(1, 301) for i in range(10)
    }
    assert client.spilled_files_seen > 0  # the bound was crossed while the store failed
    assert list(spill.iterdir()) == []  # each spilled chunk was read back and removed
    assert len(client.points) == 3000 and sink.failures == 2
    assert sink._backlog.held_points == 0 and not sink._backlog  # its count did not drift


def test_plain_and_escaped_keys_in_one_batch_give_the_json_dumps_text(tmp_path: Path) -> None:
    sink = MlflowMetricsSink(FakeClient({}), "run-2", spill_dir=tmp_path)  # type: ignore[arg-type]
    sink.report_training(1, {"loss": 0.5, 'odd"key': 1.5, "naïve": 2.0})
    points = sink._points(("training", 1, 7, {"loss": 0.5, 'odd"key': 1.5, "naïve": 2.0}))
    as_dicts = [{"key": k, "value": v, "timestamp": t, "step": s} for k, v, t, s in points]
    expected = json.dumps({"run_id": "run-2", "metrics": as_dicts})
    assert sink._batch_json(points) == expected  # escaped keys: the per-point path
    plain = [p for p in points if p[0] == "training/loss"]
    assert sink._batch_json(plain) == json.dumps(  # plain keys, finite values: the fast path
        {"run_id": "run-2", "metrics": [as_dicts[0]]}
    )
    sink.close()


def test_the_stored_step_per_key_is_each_keys_highest_in_any_order(tmp_path: Path) -> None:
    sink = MlflowMetricsSink(FakeClient({}), "run", spill_dir=tmp_path)  # type: ignore[arg-type]
    sink._stored_max = {"a": -1, "b": 7}
    sink._note_stored([("a", 0.0, 1, 3), ("b", 0.0, 1, 3), ("a", 0.0, 1, 3), ("a", 0.0, 1, 5)])
    assert sink._stored_max == {"a": 5, "b": 7}  # in step order: the last per key
    sink._note_stored([("a", 0.0, 1, 9), ("b", 0.0, 1, 8), ("a", 0.0, 1, 6)])
    assert sink._stored_max == {"a": 9, "b": 8}  # out of order: still the highest
    sink.close()


def test_what_a_caller_reuses_mlflow_refuses_or_cannot_hold_does_not_cost_other_points(
    tmp_path: Path,
) -> None:
    """The caller's dict is copied when reported; a key MLflow would refuse (the server
    would refuse its whole batch) is recorded with the refused characters as ``_``
    (Determined takes any name), and a value no float can hold is left out, alone."""
    import numpy as np

    client = FlakyClient(failures=0, spill_dir=tmp_path)
    sink = MlflowMetricsSink(client, "run", spill_dir=tmp_path)  # type: ignore[arg-type]
    reused = {"loss": 1.0, "bad{key}": 2.0, "huge": 10**400, "np": np.float32(0.5)}
    sink.report_training(1, reused)
    reused["loss"] = 99.0  # after reporting: must not change what was reported
    sink.report_training(2, {"loss": 0.5})
    sink.close()
    assert sorted((k, v, s) for k, v, _, s in client.points) == [
        ("training/bad_key_", 2.0, 1), ("training/loss", 0.5, 2), ("training/loss", 1.0, 1),
        ("training/np", 0.5, 1),
    ]  # fmt: skip
    assert sink._thread.is_alive() is False and sink.sent_points == 4


def test_a_spilled_chunk_that_cannot_be_read_back_is_reported_and_the_rest_still_arrives(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr("registry.metrics.report_backlog.CHUNK_POINTS", 2)
    spill = tmp_path / "spill"
    client = FlakyClient(failures=0, spill_dir=spill)
    # flush_interval_s: everything lands in one pass, spilled before any send.
    sink = _spilling_sink(client, spill, memory_limit=2, flush_interval_s=3600)
    for step in range(1, 7):
        sink.report_training(step, {"loss": float(step), "acc": step / 10})
    sink._absorb_inbox()  # on the test's thread: the sender waits out its interval
    assert len(list(spill.glob("*.reports"))) == 5  # steps 2-6; the head stays in memory
    step_3 = sink._backlog._chunks[2].path
    assert step_3 is not None
    step_3.write_bytes(b"not marshal data")
    sink.close()
    assert sorted({s for _, _, _, s in client.points}) == [1, 2, 4, 5, 6]
    assert sink._backlog.lost_points == 2  # and its file is left where the error names it
    assert list(spill.glob("*.reports")) == [step_3]
