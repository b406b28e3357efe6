"""A trial's end collects only its own checkpoints (issue 30: the experiment-wide pass at
every trial's end read every trial run, so a 256-trial experiment's per-trial cost grew
from 0.45 s to 1.2 s). The experiment's end still ranks the whole experiment."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from registry.checkpoints.gc import collect_experiment_garbage, collect_trial_garbage
from registry.checkpoints.store import CHECKPOINT_TAG


class RecordingClient:
    """The MLflow calls GC makes, over in-memory runs; which runs it read."""

    def __init__(self, runs: dict[str, dict[str, str]]) -> None:
        self.runs = runs
        self.read: list[str] = []
        self.searched: list[str] = []
        self.registered: dict[str, list[str]] = {}  # run -> checkpoints behind model versions

    def get_run(self, run_id: str) -> Any:
        self.read.append(run_id)
        return SimpleNamespace(
            info=SimpleNamespace(run_id=run_id), data=SimpleNamespace(tags=dict(self.runs[run_id]))
        )

    def search_model_versions(self, query: str) -> list[Any]:
        self.searched.append(query)
        run_id = query.split("'")[1]
        return [
            SimpleNamespace(tags={"det.checkpoint_uuid": uuid}, source="")
            for uuid in self.registered.get(run_id, [])
        ]

    def delete_tag(self, run_id: str, key: str) -> None:
        del self.runs[run_id][key]


def _checkpoint(root: Path, run_id: str, batches: int, loss: float) -> tuple[str, str]:
    uuid = f"{run_id}-{batches}"
    folder = root / uuid
    folder.mkdir()
    (folder / "state_dict.pth").write_bytes(b"weights")
    record = {
        "uuid": uuid,
        "steps_completed": batches,
        "s3_uri": f"file://{folder}",
        "validation_metrics": {"val_loss": loss},
    }
    return f"{CHECKPOINT_TAG}{uuid}", json.dumps(record)


def _experiment(tmp_path: Path) -> tuple[RecordingClient, Any]:
    """Two trials of three checkpoints each; trial b's batch-10 checkpoint is the
    experiment's best, and neither trial's latest is its best."""
    losses = {"a": (0.5, 0.2, 0.3), "b": (0.1, 0.4, 0.6)}
    runs = {
        run_id: dict(_checkpoint(tmp_path, run_id, 10 * (i + 1), loss) for i, loss in enumerate(ls))
        for run_id, ls in losses.items()
    }
    config = {
        "searcher": {"metric": "val_loss", "smaller_is_better": True},
        "checkpoint_storage": {
            "save_trial_latest": 1,
            "save_trial_best": 0,
            "save_experiment_best": 1,
        },
    }
    parent = SimpleNamespace(data=SimpleNamespace(tags={"det.config": json.dumps(config)}))
    return RecordingClient(runs), parent


def _on_disk(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_a_trials_end_reads_and_deletes_only_its_own_checkpoints(tmp_path: Path) -> None:
    client, parent = _experiment(tmp_path)
    result = collect_trial_garbage(client, None, parent, "a")
    assert client.read == ["a"]
    assert client.searched == ["run_id = 'a'"]
    # Its latest (30) and its own best (20, which may be the experiment's best: only the
    # experiment's end can tell) stay; its batch-10 checkpoint goes, bytes and record.
    assert result.kept == ["a-20", "a-30"]
    assert result.deleted == ["a-10"]
    assert _on_disk(tmp_path) == ["a-20", "a-30", "b-10", "b-20", "b-30"]
    assert sorted(client.runs["a"]) == [f"{CHECKPOINT_TAG}a-20", f"{CHECKPOINT_TAG}a-30"]


def test_the_experiments_end_keeps_only_the_experiments_best(tmp_path: Path) -> None:
    client, parent = _experiment(tmp_path)
    for run_id in ("a", "b"):
        collect_trial_garbage(client, None, parent, run_id)
    runs = [client.get_run(r) for r in ("a", "b")]
    result = collect_experiment_garbage(client, None, parent, runs)
    # Each trial's latest, and the one best of the whole experiment (b at batch 10).
    assert result.kept == ["a-30", "b-10", "b-30"]
    assert result.deleted == ["a-20"]
    assert _on_disk(tmp_path) == ["a-30", "b-10", "b-30"]


def test_a_trial_that_keeps_all_it_has_does_not_ask_the_model_registry(tmp_path: Path) -> None:
    client, parent = _experiment(tmp_path)
    (tmp_path / "single").mkdir()
    client.runs["a"] = dict([_checkpoint(tmp_path / "single", "a", 30, 0.3)])
    result = collect_trial_garbage(client, None, parent, "a")
    assert result.kept == ["a-30"] and result.deleted == [] and result.protected == []
    assert client.searched == []


def test_a_registered_checkpoint_is_kept_past_the_policy(tmp_path: Path) -> None:
    client, parent = _experiment(tmp_path)
    client.registered["a"] = ["a-10"]
    result = collect_trial_garbage(client, None, parent, "a")
    assert client.searched == ["run_id = 'a'"]
    assert result.deleted == [] and result.protected == ["a-10"]
    assert _on_disk(tmp_path) == ["a-10", "a-20", "a-30", "b-10", "b-20", "b-30"]
