"""The trials table's "best" is the trial's best validation (not the last one), under
either ordering; the table is created once and then updated in place, with a progress
artifact beside it; rows are best first, one column per hyperparameter, 4 significant
digits. Prefect's artifact calls are replaced by recorders here (the real server is in
tests/integration/test_user_view.py); MLflow by a fake client."""

from __future__ import annotations

import json
import math
import types
import uuid
from typing import Any

import pytest

from flows import trial_table
from flows.trial_table import TrialTable, significant
from registry.experiment_view import TrialBest, best_point, trial_best

# The const run: validation_error rises after its best (batch 132).
CONST_HISTORY = [(44, 0.0606), (88, 0.0485), (132, 0.0208), (176, 0.0225)]


def test_best_point_is_the_best_not_the_last():
    assert best_point(CONST_HISTORY, smaller_is_better=True) == (132, 0.0208)
    accuracy = [(44, 0.9394), (88, 0.9515), (132, 0.9792), (176, 0.9775)]
    assert best_point(accuracy, smaller_is_better=False) == (132, 0.9792)


def test_best_point_ties_go_to_the_earlier_step_and_nan_is_never_best():
    assert best_point([(10, 0.5), (20, 0.3), (30, 0.3)], True) == (20, 0.3)
    assert best_point([(10, math.nan), (20, 0.9), (30, math.inf)], True) == (20, 0.9)
    assert best_point([(10, math.nan)], True) is None
    assert best_point([], False) is None


class FakeMlflow:
    """get_metric_history and get_run, as trial_best reads them."""

    def __init__(self, history: list[tuple[int, float]], records: list[dict[str, Any]]):
        self.history = history
        self.records = records

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        assert key == "validation/validation_error"
        return [types.SimpleNamespace(step=s, value=v) for s, v in self.history]

    def get_run(self, run_id: str) -> Any:
        tags = {f"det.checkpoint.{i}": json.dumps(r) for i, r in enumerate(self.records)}
        return types.SimpleNamespace(data=types.SimpleNamespace(tags=tags))


def record(step: int, value: float) -> dict[str, Any]:
    return {
        "steps_completed": step,
        "uri": f"s3://b/ckpt-{step}",
        "validation_metrics": {"validation_error": value},
    }


def test_trial_best_reads_the_whole_history_and_ranks_checkpoints_the_same_way():
    # checkpoint_policy best: checkpoints at each new best (44, 88, 132) and the last (176).
    client = FakeMlflow(CONST_HISTORY, [record(s, v) for s, v in CONST_HISTORY])
    best = trial_best(client, "run", "validation_error", smaller_is_better=True)  # type: ignore[arg-type]
    assert best == TrialBest(0.0208, 132, "s3://b/ckpt-132")
    larger = trial_best(client, "run", "validation_error", smaller_is_better=False)  # type: ignore[arg-type]
    assert larger == TrialBest(0.0606, 44, "s3://b/ckpt-44")


def test_trial_best_without_history_falls_back_to_the_checkpoint_records():
    client = FakeMlflow([], [record(50, 0.4), record(100, 0.2)])
    best = trial_best(client, "run", "validation_error", smaller_is_better=True)  # type: ignore[arg-type]
    assert best == TrialBest(0.2, 100, "s3://b/ckpt-100")


class Artifacts:
    """Records the Prefect calls TrialTable makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tables: list[tuple[str | None, list[dict[str, Any]]]] = []
        self.progress: list[tuple[str | None, float, str | None]] = []
        self.table_updates: list[tuple[uuid.UUID, list[dict[str, Any]]]] = []
        self.progress_updates: list[tuple[uuid.UUID, float, str | None]] = []
        self.table_id, self.progress_id = uuid.uuid4(), uuid.uuid4()
        client = types.SimpleNamespace(
            update_artifact=lambda i, update: self.table_updates.append(
                (i, json.loads(update.data))
            )
        )
        monkeypatch.setattr(trial_table, "create_table_artifact", self._create_table)
        monkeypatch.setattr(trial_table, "create_progress_artifact", self._create_progress)
        monkeypatch.setattr(trial_table, "update_progress_artifact", self._update_progress)
        monkeypatch.setattr(trial_table, "get_client", lambda sync_client: client)

    def _create_table(self, table: list[dict[str, Any]], key: str, description: str) -> Any:
        self.tables.append((key, table))
        return self.table_id

    def _create_progress(self, progress: float, key: str, description: str) -> Any:
        self.progress.append((key, progress, description))
        return self.progress_id

    def _update_progress(self, artifact_id: uuid.UUID, progress: float, description: str) -> Any:
        self.progress_updates.append((artifact_id, progress, description))
        return artifact_id

    def latest_table(self) -> list[dict[str, Any]]:
        return self.table_updates[-1][1] if self.table_updates else self.tables[-1][1]


def const_table(**kwargs: Any) -> TrialTable:
    table = TrialTable(
        "mnist const",
        "validation_error",
        True,
        lambda run_id: f"http://mlflow/#/runs/{run_id}",
        **kwargs,
    )
    table.add(1, {"learning_rate": 1.0, "n_filters1": 32, "opt": {"beta": 0.123456}}, "r1")
    return table


def test_a_finished_trial_row_shows_its_best_validation_not_its_last(monkeypatch):
    artifacts = Artifacts(monkeypatch)
    looked_up: list[str] = []

    def best_of(run_id: str) -> TrialBest:
        looked_up.append(run_id)
        return TrialBest(0.0208, 132, "s3://b/ckpt-132")

    table = const_table(best_of=best_of, total_trials=1)
    table.set_state(1, "RUNNING")
    table.publish()
    # One segment, [0, 176): the flow sees only the validation at its end.
    table.segment_done(1, 176, 0.0225, "s3://b/ckpt-176")
    table.set_state(1, "COMPLETED")
    table.publish()
    table.publish()
    assert looked_up == ["r1"]  # once, when the trial's run is complete
    (row,) = artifacts.latest_table()
    assert row["best validation_error"] == 0.0208 and row["best at batch"] == 132
    assert row["best checkpoint"] == "s3://b/ckpt-132"
    assert row["validation_error"] == 0.0225 and row["batches"] == 176
    assert table.best() == {
        "trial_id": 1,
        "metric": 0.0208,
        "step": 132,
        "hparams": {"learning_rate": 1.0, "n_filters1": 32, "opt": {"beta": 0.123456}},
        "checkpoint": "s3://b/ckpt-132",
        "batches_trained": 176,
    }


def test_live_rows_keep_their_best_segment_under_either_ordering(monkeypatch):
    Artifacts(monkeypatch)
    for smaller, best_value, best_step in ((True, 0.3, 12), (False, 0.6, 50)):
        table = TrialTable("asha", "m", smaller, str, best_of=lambda r: TrialBest(None, None, None))
        table.add(1, {"lr": 0.1}, "r1")
        table.segment_done(1, 12, 0.3, "ckpt-12")
        table.segment_done(1, 50, 0.6, "ckpt-50")  # promoted, then got worse (or better)
        table.set_state(1, "PAUSED")
        table.publish()
        assert table.best() is not None
        assert (table.best()["metric"], table.best()["step"]) == (best_value, best_step)  # type: ignore[index]
        assert table.best()["checkpoint"] == f"ckpt-{best_step}"  # type: ignore[index]


def test_table_is_created_once_then_updated_in_place_with_progress(monkeypatch):
    artifacts = Artifacts(monkeypatch)
    table = TrialTable("Grid Search!", "loss", False, str, total_trials=4, best_of=None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for trial_id, acc in ((1, 0.5), (2, 0.912345), (3, 0.7)):
        table.add(trial_id, {"lr": trial_id / 3, "hidden": 4}, f"r{trial_id}")
        table.segment_done(trial_id, 40, acc, f"ckpt-{trial_id}")
        table.set_state(trial_id, "COMPLETED")
        table.publish()
    table.add(4, {"lr": 2.0, "hidden": 8}, "r4")
    table.set_state(4, "INVALID_HP")
    table.publish()

    assert [key for key, _ in artifacts.tables] == ["grid-search-trials"]
    assert [key for key, _, _ in artifacts.progress] == ["grid-search-progress"]
    assert {i for i, _ in artifacts.table_updates} == {artifacts.table_id}
    assert len(artifacts.table_updates) == 3
    assert [p for _, p, _ in artifacts.progress_updates] == [50.0, 75.0, 100.0]
    assert artifacts.progress[0][1] == 25.0
    assert (
        artifacts.progress_updates[-1][2] == "4 of 4 trials of experiment 'Grid Search!' finished"
    )

    rows = artifacts.latest_table()
    # Larger is better: best first, the trial without a metric last.
    assert [r["trial"] for r in rows] == [2, 3, 1, 4]
    assert rows[0]["best loss"] == 0.9123 and rows[0]["lr"] == 0.6667
    assert rows[0]["hidden"] == 4 and "hparams" not in rows[0]
    assert rows[-1]["best loss"] is None and rows[-1]["state"] == "INVALID_HP"
    assert list(rows[0]) == [
        "trial",
        "state",
        "batches",
        "best loss",
        "best at batch",
        "loss",
        "lr",
        "hidden",
        "best checkpoint",
        "mlflow",
    ]


def test_hyperparameters_named_like_a_column_keep_their_own_column(monkeypatch):
    Artifacts(monkeypatch)
    table = TrialTable("e", "loss", True, str, best_of=None)
    table.add(1, {"state": "on", "nested": {"a": 1}}, "r1")
    (row,) = table.table()
    assert row["state"] == "QUEUED" and row["hp.state"] == "on" and row["nested.a"] == 1


def test_numbers_are_shown_to_four_significant_digits():
    assert significant(0.020833333) == 0.02083
    assert significant(123456.7) == 123500.0
    assert significant(1.23456e-7) == 1.235e-07
    assert significant(7) == 7 and significant(True) is True and significant("x") == "x"
    assert significant(math.nan) == "nan" and significant(-math.inf) == "-inf"
    assert significant(None) is None


def test_trial_ends_publish_at_most_every_interval_and_the_last_change_is_sent(monkeypatch):
    """publish_soon: at most one send per interval (2 s, or 10 ms a trial for large
    tables), the change it held back sent once the interval has passed."""
    artifacts = Artifacts(monkeypatch)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    now = [1000.0]
    monkeypatch.setattr(trial_table.time, "monotonic", lambda: now[0])
    table = TrialTable("big", "loss", True, str, total_trials=400, best_of=None)
    for trial_id in range(1, 301):
        table.add(trial_id, {"lr": 0.1}, f"r{trial_id}")
    assert table.publish_interval_s == pytest.approx(3.0)  # 300 trials x 10 ms
    table.set_state(1, "COMPLETED")
    table.publish_soon()  # the first: sent at once
    for trial_id in (2, 3):
        now[0] += 1.0
        table.set_state(trial_id, "COMPLETED")
        table.publish_soon()  # held back: 1 s and 2 s after the last send
        table.publish_if_stale()
    assert len(artifacts.tables) == 1 and artifacts.table_updates == []
    now[0] += 1.0  # 3 s: due
    table.publish_if_stale()
    table.publish_if_stale()  # nothing new since: nothing sent
    assert len(artifacts.table_updates) == 1
    states = {r["trial"]: r["state"] for r in artifacts.latest_table()}
    assert [states[t] for t in (1, 2, 3)] == ["COMPLETED"] * 3
    assert TrialTable("small", "loss", True, str, best_of=None).publish_interval_s == 2.0
