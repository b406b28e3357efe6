"""One reading of a trial's numbers (registry.experiments.view.trial_progress): batches
trained from progress/batches, the best validation (not the last) under either ordering,
the latest one, the best checkpoint. The trials table shows that reading for every row,
read again as trials change, run and end (kept after a pause or a kill), is created once
and then updated in place, with a progress artifact beside it; rows are best first, one
column per hyperparameter, 4 significant digits; the best row goes to the parent run's
det.best.* tags. Prefect's artifact calls are replaced by recorders here (the real server
is in tests/integration/test_user_view.py); MLflow by a fake client."""

from __future__ import annotations

import json
import math
import types
import uuid
from typing import Any

import pytest

from flows import trial_table
from flows.trial_table import TrialTable, significant
from registry.experiments.view import (
    TrialProgress,
    best_point,
    read_trial_progress,
    trial_progress,
)

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


def record(step: int, value: float | None = None) -> dict[str, Any]:
    metrics = {} if value is None else {"validation_error": value}
    return {"steps_completed": step, "uri": f"s3://b/ckpt-{step}", "validation_metrics": metrics}


def run(
    run_id: str = "run",
    records: list[dict[str, Any]] = (),  # type: ignore[assignment]
    batches: float | None = None,
    trial: str = "1",
    status: str = "RUNNING",
    state: str | None = None,
    params: dict[str, str] | None = None,
) -> Any:
    """A trial run as MLflow's client (or registry.runs.mlflow_rest) returns it."""
    tags = {f"det.checkpoint.{r['steps_completed']}": json.dumps(r) for r in records}
    tags["det.trial_id"] = trial
    if state:
        tags["det.state"] = state
    metrics = {} if batches is None else {"progress/batches": batches}
    return types.SimpleNamespace(
        info=types.SimpleNamespace(run_id=run_id, status=status, experiment_id="1"),
        data=types.SimpleNamespace(tags=tags, metrics=metrics, params=params or {}),
    )


def points(history: list[tuple[int, float]]) -> list[Any]:
    return [types.SimpleNamespace(step=s, value=v, timestamp=1000 + i) for i, (s, v) in
            enumerate(history)]  # fmt: skip


class FakeMlflow:
    """The MlflowClient calls the views and the table make, over runs held here."""

    def __init__(self) -> None:
        self.runs: dict[str, Any] = {}
        self.histories: dict[str, list[tuple[int, float]]] = {}
        self.reads: list[str] = []
        self.tags: dict[str, dict[str, str]] = {}

    def put(self, trial_run: Any, history: list[tuple[int, float]]) -> None:
        self.runs[trial_run.info.run_id] = trial_run
        self.histories[trial_run.info.run_id] = history

    def get_run(self, run_id: str) -> Any:
        self.reads.append(run_id)
        if run_id == "parent":
            return types.SimpleNamespace(
                info=types.SimpleNamespace(run_id="parent", experiment_id="1"),
                data=types.SimpleNamespace(tags={}, metrics={}, params={}),
            )
        return self.runs[run_id]

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        assert key in ("validation/validation_error", "validation/loss")
        return points(self.histories[run_id])

    def search_runs(self, experiment_ids: list[str], filter_string: str = "") -> list[Any]:
        assert filter_string == "tags.`mlflow.parentRunId` = 'parent'"
        return list(self.runs.values())

    def log_batch(self, run_id: str, tags: list[Any]) -> None:
        self.tags.setdefault(run_id, {}).update({t.key: t.value for t in tags})


def test_trial_progress_is_the_best_validation_and_progress_batches():
    # checkpoint_policy best: checkpoints at each new best (44, 88, 132) and the last (176).
    trial = run(records=[record(s, v) for s, v in CONST_HISTORY], batches=176.0)
    best = trial_progress(trial, points(CONST_HISTORY), "validation_error", True)
    assert best == TrialProgress(176, 0.0208, 132, 0.0225, 176, "s3://b/ckpt-132")
    larger = trial_progress(trial, points(CONST_HISTORY), "validation_error", False)
    assert larger == TrialProgress(176, 0.0606, 44, 0.0225, 176, "s3://b/ckpt-44")


def test_a_killed_trial_counts_the_batches_it_trained_past_its_last_checkpoint():
    """The issue's killed trial: 14 validations (best 0.0173 at 528), checkpoints up to
    1390, progress/batches 1650: batches is 1650, not the newest checkpoint's step."""
    history = [(44 * i, 0.05 - 0.001 * i) for i in range(1, 13)] + [(528, 0.0173), (1628, 0.02)]
    history.sort()
    trial = run(records=[record(s) for s in (132, 88, 44, 1390)], batches=1650.0, state="CANCELED")
    got = trial_progress(trial, points(history), "validation_error", True)
    assert (got.batches, got.best, got.best_step) == (1650, 0.0173, 528)
    assert (got.latest, got.latest_step) == (0.02, 1628)
    assert got.checkpoint == "s3://b/ckpt-1390"  # none validated: the newest


def test_trial_progress_without_history_falls_back_to_the_checkpoint_records():
    trial = run(records=[record(50, 0.4), record(100, 0.2)])  # imported: no metrics at all
    got = trial_progress(trial, [], "validation_error", True)
    assert got == TrialProgress(100, 0.2, 100, None, None, "s3://b/ckpt-100")


def test_read_trial_progress_reads_the_run_and_its_history():
    client = FakeMlflow()
    client.put(run(records=[record(132, 0.0208)], batches=150.0), CONST_HISTORY[:3])
    got = read_trial_progress(client, "run", "validation_error", True)
    assert got == TrialProgress(150, 0.0208, 132, 0.0208, 132, "s3://b/ckpt-132")


NOTHING = TrialProgress(0, None, None, None, None, None)


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


def const_table(client: FakeMlflow, **kwargs: Any) -> TrialTable:
    table = TrialTable(
        "mnist const",
        "validation_error",
        True,
        lambda run_id: f"http://mlflow/#/runs/{run_id}",
        client=client,
        **kwargs,
    )
    table.add(1, {"learning_rate": 1.0, "n_filters1": 32, "opt": {"beta": 0.123456}}, "r1")
    return table


def test_a_finished_trial_row_shows_its_best_validation_not_its_last(monkeypatch):
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    client.put(run("r1", [record(176, 0.0225), record(132, 0.0208)], 176.0), CONST_HISTORY)
    table = const_table(client, total_trials=1)
    table.set_state(1, "RUNNING")
    table.publish_soon()
    # One segment, [0, 176): the flow sees only the validation at its end; MLflow has all.
    table.segment_done(1, 176, 0.0225, "s3://b/ckpt-176")
    table.set_state(1, "COMPLETED")
    client.reads.clear()
    monkeypatch.setattr(trial_table.time, "monotonic", lambda: 1e9)
    table.publish_soon()
    table.publish_if_stale()  # nothing changed since: nothing read, nothing sent
    assert client.reads == ["r1"]  # once for the change
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


def test_rows_keep_their_numbers_after_a_pause_and_a_kill(monkeypatch):
    """The issue's user: after pause the row's best was empty and its metric nan; after
    kill batches 0 and everything empty. Now: what MLflow holds, whatever stopped it."""
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    history = [(44, 0.05), (88, 0.03), (528, 0.0173), (616, 0.019)]
    client.put(run("r1", [record(44), record(328)], 328.0), history[:2])
    table = const_table(client)
    table.set_state(1, "RUNNING")
    table.set_state(1, "PAUSED")  # paused at 328: a checkpoint there, no validation
    table.segment_done(1, 328, math.nan, "s3://b/ckpt-328")
    table.publish()
    (row,) = artifacts.latest_table()
    assert (row["state"], row["batches"], row["best validation_error"]) == ("PAUSED", 328, 0.03)
    assert (row["best at batch"], row["validation_error"]) == (88, 0.03)
    # Activated, trained on, killed at 1650 (no checkpoint at the kill).
    client.put(run("r1", [record(44), record(328), record(1390)], 1650.0), history)
    table.set_state(1, "RUNNING")
    table.set_state(1, "CANCELED")
    table.publish()
    (row,) = artifacts.latest_table()
    assert (row["state"], row["batches"], row["best validation_error"]) == (
        "CANCELED",
        1650,
        0.0173,
    )
    assert (row["best at batch"], row["validation_error"]) == (528, 0.019)
    assert row["best checkpoint"] == "s3://b/ckpt-1390"


def test_an_activated_experiments_table_starts_with_every_trial_of_its_parent(monkeypatch):
    """Trials that ended before this flow run (not started again) keep their rows, numbers
    and states; the best row is on the parent's det.best.* tags."""
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    client.put(run("r1", [record(40, 0.2)], 40.0, "1", "FINISHED", "COMPLETED",
                   {"hp.lr": "0.1", "hp.name": "adam"}), [(40, 0.2)])  # fmt: skip
    client.put(
        run("r2", [record(20)], 25.0, "2", "KILLED", "PAUSED", {"hp.lr": "0.5"}), [(20, 0.4)]
    )
    table = TrialTable("e", "validation_error", True, str, client=client, parent_run_id="parent")
    table.add(2, {"lr": 0.5}, "r2")  # the paused trial, started again
    table.set_state(2, "RUNNING")
    table.publish_soon()
    rows = artifacts.latest_table()
    assert [(r["trial"], r["state"], r["batches"]) for r in rows] == [
        (1, "COMPLETED", 40),
        (2, "RUNNING", 25),
    ]
    assert rows[0]["lr"] == 0.1 and rows[0]["name"] == "adam"
    best = client.tags["parent"]
    assert best["det.best.trial_id"] == "1" and best["det.best.step"] == "40"
    assert best["det.best.validation_error"] == "0.2" and best["det.best.hp.lr"] == "0.1"
    assert best["det.best.checkpoint"] == "s3://b/ckpt-40" and best["det.best.run_id"] == "r1"
    client.put(run("r2", [record(20)], 60.0, "2"), [(20, 0.4), (60, 0.1)])
    monkeypatch.setattr(trial_table.time, "monotonic", lambda: 1e9)
    table.publish_if_stale()  # a running row is read again every LIVE_REFRESH_S
    assert artifacts.latest_table()[0]["trial"] == 2
    assert client.tags["parent"]["det.best.trial_id"] == "2"
    assert client.tags["parent"]["det.best.step"] == "60"


def test_table_is_created_once_then_updated_in_place_with_progress(monkeypatch):
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    for trial_id, acc in ((1, 0.5), (2, 0.912345), (3, 0.7), (4, math.nan)):
        client.put(run(f"r{trial_id}", [], 40.0, str(trial_id)), [(40, acc)])
    table = TrialTable("Grid Search!", "loss", False, str, total_trials=4, client=client)
    for trial_id in (1, 2, 3):
        table.add(trial_id, {"lr": trial_id / 3, "hidden": 4}, f"r{trial_id}")
        table.segment_done(trial_id, 40, 0.0, f"ckpt-{trial_id}")
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
    assert rows[-1]["loss"] == "nan"  # its latest validation, as MLflow has it
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
    table = TrialTable("e", "loss", True, str, progress_of=lambda run_id: NOTHING)
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
    table = TrialTable("big", "loss", True, str, total_trials=400, progress_of=lambda r: NOTHING)
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
    assert TrialTable("small", "loss", True, str).publish_interval_s == 2.0


def test_a_waiting_trial_says_why_in_a_column_the_table_has_only_while_one_waits(monkeypatch):
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    client.put(run("r1", [], 0.0), [])
    table = const_table(client)
    reason = "waiting for a slot: 1 experiment(s) ahead at priority 42 or more urgent"
    table.set_state(1, "QUEUED", reason)
    table.publish()
    (row,) = artifacts.latest_table()
    assert (row["state"], row["waiting for"]) == ("QUEUED", reason)
    table.set_state(1, "RUNNING")
    table.publish()
    (row,) = artifacts.latest_table()
    assert row["state"] == "RUNNING" and "waiting for" not in row


def searcher_config(max_length: dict[str, int], **more: Any) -> Any:
    from det_tasks.config.loader import parse_config

    searcher = {"name": "random", "metric": "validation_error", "max_trials": 4}
    return parse_config(
        {
            "entrypoint": "model_def:Trial",
            "hyperparameters": {"global_batch_size": 8},
            "searcher": {**searcher, "max_length": max_length},
            **more,
        }
    )


def test_one_trials_progress_counts_its_batches_not_only_its_end(monkeypatch):
    """The issue's one-trial experiment read 0% until its end (finished trials only)."""
    artifacts = Artifacts(monkeypatch)
    client = FakeMlflow()
    lengths = trial_table.searcher_batches(searcher_config({"batches": 200}))
    table = const_table(client, total_trials=1, trial_batches=lengths)
    table.set_state(1, "RUNNING")
    for batches, percent in ((50, 25.0), (150, 75.0)):
        client.put(run("r1", [], float(batches)), [])
        table.publish()
        (_, shown, text), *_ = artifacts.progress_updates[-1:] or artifacts.progress
        assert shown == percent
        assert text == (
            f"0 of 1 trials of experiment 'mnist const' finished ({batches} of 200 batches trained)"
        )
    table.set_state(1, "COMPLETED")
    table.publish()
    assert artifacts.progress_updates[-1][1] == 100.0


def test_many_trials_progress_counts_batches_and_a_stopped_trial_whole(monkeypatch):
    """4 trials of {records: 800} at 8 a batch (100 batches each): one stopped by the
    searcher at 12 counts whole, one running at 50 counts 50, two not yet proposed count
    the known trials' mean length: 150 of 400. Lengths only a data loader knows (epochs
    without records_per_epoch) count finished trials, as before."""
    Artifacts(monkeypatch)
    client = FakeMlflow()
    client.put(run("r1", [], 12.0, "1", status="FINISHED", state="STOPPED"), [])
    client.put(run("r2", [], 50.0, "2"), [])
    for max_length, expected in (({"records": 800}, (150, 400)), ({"epochs": 1}, None)):
        lengths = trial_table.searcher_batches(searcher_config(max_length))
        table = const_table(client, total_trials=4, trial_batches=lengths)
        table.add(1, {"global_batch_size": 8}, "r1")  # the searcher's values
        table.add(2, {"global_batch_size": 8}, "r2")
        table.set_state(1, "STOPPED")
        table.set_state(2, "RUNNING")
        table.refresh(every_row=True)
        assert table.batches() == expected
        assert table.percent() == (37.5 if expected else 25.0)
    with_epochs = searcher_config({"epochs": 2}, records_per_epoch=400)
    assert trial_table.searcher_batches(with_epochs)({"global_batch_size": 8}) == 100
