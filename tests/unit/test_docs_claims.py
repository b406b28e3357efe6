"""The README's table "Deliberately different from Determined" against the code. Each row's
claim has a check here that fails when the code stops doing what the row says, and every
test the row names exists; a row without a check fails, so a new claim comes with one."""

from __future__ import annotations

import ast
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Deliberately different from Determined"


def claims_table(text: str) -> list[tuple[str, str, str]]:
    """(Determined, det-tasks, test) per row of the section's table."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]
    assert all(len(c) == 3 for c in cells), f"{SECTION}: every row has three cells"
    return [(c[0], c[1], c[2]) for c in cells]


def _weights_only_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from det_tasks.checkpoints import format as checkpoint_format

    torch.save({"w": torch.ones(2)}, tmp_path / checkpoint_format.STATE_FILE)
    seen: list[dict[str, object]] = []
    real_load = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    state = checkpoint_format.read_state(tmp_path)
    assert torch.equal(state["w"], torch.ones(2))
    assert [k.get("weights_only") for k in seen] == [True]


def _fit(
    store: Path, batches: int, latest: str | None = None, profiling: bool = False
) -> tuple[Any, Any, Any]:
    from det_tasks import pytorch
    from det_tasks.checkpoints.store import LocalDirectoryStore
    from det_tasks.sinks import InMemoryMetricsSink
    from tests.fixtures.trials import NoisyMLPTrial

    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"global_batch_size": 8},
        seed=3,
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(store),
    )
    trial = NoisyMLPTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches),
        reporting_period=pytorch.Batch(1),
        checkpoint_policy="none",
        latest_checkpoint=latest,
        profiling_enabled=profiling,
    )
    return trial, sink, result


def _resume_skips_to_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed mid-epoch (12 batches an epoch; batch 15 is in the second), the run goes on
    from batch 16 with the recorded order: the same losses and weights as one run."""
    full, full_sink, _ = _fit(tmp_path / "full", 20)
    _, _, first = _fit(tmp_path / "cut", 15)
    resumed, resumed_sink, _ = _fit(tmp_path / "cut", 20, latest=first.checkpoint_uuid)
    assert [s for s, _ in resumed_sink.training] == list(range(16, 21))
    assert resumed_sink.training == [(s, m) for s, m in full_sink.training if s > 15]
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


def _checkpoint_policy_typo_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from det_tasks.config.loader import parse_config
    from det_tasks.errors import ConfigError

    raw = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 8},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 1}},
        "checkpoint_policy": "bset",
    }
    with pytest.raises(ConfigError, match="checkpoint_policy") as refused:
        parse_config(raw)
    assert "best" in str(refused.value).replace("bset", "")


def _train_unit_below_one_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from det_tasks import pytorch

    for unit in (pytorch.Batch, pytorch.Epoch):
        with pytest.raises(ValueError, match=r"\(0\)"):
            unit(0)


def _short_hex_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from det_cli.ids import short_id

    run = uuid.uuid4()
    assert short_id(run) == run.hex[:8]


def _batch_process_and_profiling_run_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cluster, no servers: every record is processed once, and a profiled fit reports
    its phase timings."""
    from det_tasks.pytorch.experimental import TorchBatchProcessor, torch_batch_process

    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path))
    monkeypatch.setenv("DET_TASKS_JOB_ID", "claims")
    for name in ("MLFLOW_TRACKING_URI", "DET_TASKS_CLUSTER_INFO"):
        monkeypatch.delenv(name, raising=False)
    seen: list[int] = []

    class Record(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            seen.extend(int(i) for i in batch)

    torch_batch_process(Record, list(range(7)), batch_size=2)
    assert sorted(seen) == list(range(7))
    _, sink, _ = _fit(tmp_path / "profiled", 3, profiling=True)
    assert [step for step, _ in sink.profiling] == [3]
    assert "train_batch_ms" in sink.profiling[0][1]


# Keyed by the start of the row's Determined cell.
CHECKS: dict[str, Callable[[Path, pytest.MonkeyPatch], None]] = {
    "`torch.load(weights_only=False)`": _weights_only_by_default,
    "local-mode resume replays data from batch 0": _resume_skips_to_the_batch,
    "a `checkpoint_policy` typo": _checkpoint_policy_typo_refused,
    "`TrainUnit` below 1": _train_unit_below_one_refused,
    "integer experiment ids": _short_hex_ids,
    "`TorchBatchProcessor` and `fit(profiling_enabled=True)`": (
        _batch_process_and_profiling_run_locally
    ),
}


def _check_for(determined: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    found = [check for key, check in CHECKS.items() if determined.startswith(key)]
    assert len(found) == 1, f"README row {determined!r} has no check in {__file__}: add one"
    return found[0]


ROWS = claims_table(README.read_text())


def test_the_table_is_found_and_every_check_has_its_row():
    assert len(ROWS) >= 5
    for key in CHECKS:
        assert any(row[0].startswith(key) for row in ROWS), f"no README row for {key!r}"


@pytest.mark.parametrize("row", ROWS, ids=[r[0][:40] for r in ROWS])
def test_each_rows_claim_holds_in_the_code(row, tmp_path, monkeypatch):
    _check_for(row[0])(tmp_path, monkeypatch)


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    for folder in ("tests/unit", "tests/integration"):
        file = ROOT / folder / path
        if file.is_file():
            if not name:
                return True
            tree = ast.parse(file.read_text())
            return any(getattr(node, "name", None) == name for node in ast.walk(tree))
    return False


@pytest.mark.parametrize("row", ROWS, ids=[r[0][:40] for r in ROWS])
def test_every_test_a_row_names_exists(row):
    names = re.findall(r"`([^`]+\.py(?:::\w+)?)`", row[2])
    assert names or not row[2], f"unreadable test cell {row[2]!r}"
    for name in names:
        assert _test_exists(name), f"README row {row[0]!r} names {name}, which does not exist"


def test_validation_averages_keep_the_metrics_dtype_as_determined():
    """Why the table has no float64 row since issue 41: a float32 metric averages in
    float32, as Determined's numpy reduction does. Were it float64 again, the README would
    need its row back."""
    from det_tasks.pytorch import Reducer
    from det_tasks.pytorch._api.reducer import reduce_batch_metrics

    batches = [{"loss": np.float32(0.1)}, {"loss": np.float32(0.2)}, {"loss": np.float32(0.4)}]
    reduced = reduce_batch_metrics(Reducer.AVG, [batches])["loss"]
    assert type(reduced) is np.float32
    assert reduced == np.average(np.array([0.1, 0.2, 0.4], dtype=np.float32))
    assert not any("float64" in row[1] for row in ROWS)


def test_a_false_claim_or_a_row_without_a_check_fails(tmp_path, monkeypatch):
    """The checks compare with the code, not with themselves."""
    from det_cli import ids

    monkeypatch.setattr(ids, "short_id", lambda run: str(run)[-8:])
    with pytest.raises(AssertionError):
        _short_hex_ids(tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="has no check"):
        _check_for("a claim nobody checks")
    table = f"{SECTION}\n\n| a | b | c |\n| --- | --- | --- |\n| x | y | `nope.py` |\n"
    row = claims_table(table)[0]
    with pytest.raises(AssertionError, match="does not exist"):
        test_every_test_a_row_names_exists(row)
