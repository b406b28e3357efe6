"""``determined.pytorch.experimental.torch_batch_process`` in one process, no servers:
known answers (y = 2x + 1), every record once, resume skips finished batches, Determined's
argument checks, and ``from determined.pytorch import experimental`` through the alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from det_tasks.pytorch.experimental import TorchBatchProcessor, torch_batch_process


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.tensor([float(i)])


class Boom(Exception):
    pass


class Linear(TorchBatchProcessor):
    """y = 2x + 1; writes each checkpoint interval's rows to a file named by its first batch."""

    calls: list[int] = []
    checkpoints: list[int] = []
    fail_at: int | None = None

    def __init__(self, context) -> None:
        self.context = context
        model = nn.Linear(1, 1)
        with torch.no_grad():
            model.weight.fill_(2.0)
            model.bias.fill_(1.0)
        self.model = context.prepare_model_for_inference(model)
        self.rows: list[list[float]] = []
        self.first: int | None = None
        self.count = context.wrap_reducer(sum, name="records")

    def process_batch(self, batch, batch_idx: int) -> None:
        if batch_idx == Linear.fail_at:
            raise Boom(batch_idx)
        Linear.calls.append(batch_idx)
        ids, x = self.context.to_device(batch)
        with torch.no_grad():
            y = self.model(x)[:, 0]
        self.first = batch_idx if self.first is None else self.first
        self.rows += [[int(i), float(v)] for i, v in zip(ids, y, strict=True)]
        self.count.update(len(ids))

    def on_checkpoint_start(self) -> None:
        Linear.checkpoints.append(len(Linear.calls))
        with self.context.upload_path() as path:
            (path / f"rows_{self.first:04d}.json").write_text(json.dumps(self.rows))
        self.rows, self.first = [], None

    def on_finish(self) -> None:
        self.context.report_task_using_checkpoint("runs:/abc/checkpoints/uuid-1")


@pytest.fixture
def job(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path))
    monkeypatch.setenv("DET_TASKS_JOB_ID", "job-1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DET_TASKS_CLUSTER_INFO", raising=False)
    Linear.calls, Linear.checkpoints, Linear.fail_at = [], [], None
    return tmp_path / "jobs" / "job-1"


def uploaded_rows(job: Path) -> list[list[float]]:
    return [
        row
        for f in sorted(job.glob("outputs/*/rank_0/*.json"))
        for row in json.loads(f.read_text())
    ]


def test_known_answers_every_record_once_metrics_and_lineage(job):
    torch_batch_process(Linear, Numbers(50), batch_size=4, checkpoint_interval=3)
    rows = uploaded_rows(job)
    assert sorted(int(i) for i, _ in rows) == list(range(50))
    assert all(y == 2 * i + 1 for i, y in rows)
    assert Linear.calls == list(range(13))  # ceil(50 / 4)
    assert Linear.checkpoints == [3, 6, 9, 12, 13]  # every 3 batches, then the last one
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [{"group": "validation", "steps_completed": 13, "metrics": {"records": 50}}]
    tags = json.loads((job / "tags.json").read_text())
    assert tags == {"det.uses_checkpoint": "runs:/abc/checkpoints/uuid-1", "status": "FINISHED"}
    kept = list((job / "checkpoints").glob("*/batch_completed.json"))
    assert [json.loads(p.read_text()) for p in kept] == [{"batch_completed": 13}]


def test_a_failed_job_resumes_after_its_last_progress_checkpoint(job):
    Linear.fail_at = 7
    with pytest.raises(Boom):
        torch_batch_process(Linear, Numbers(50), batch_size=4, checkpoint_interval=3)
    assert Linear.calls == list(range(7))
    Linear.calls, Linear.fail_at = [], None
    torch_batch_process(Linear, Numbers(50), batch_size=4, checkpoint_interval=3)
    assert Linear.calls == list(range(6, 13))  # batches 0-5 were checkpointed, 6 was not
    rows = uploaded_rows(job)
    assert sorted(int(i) for i, _ in rows) == list(range(50))  # each record exactly once


def test_max_batches_caps_each_rank(job):
    torch_batch_process(Linear, Numbers(50), batch_size=4, max_batches=5, checkpoint_interval=2)
    assert Linear.calls == [0, 1, 2, 3, 4]
    assert sorted(int(i) for i, _ in uploaded_rows(job)) == list(range(20))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataloader_kwargs": {"shuffle": True}}, "shuffle=True is not allowed"),
        ({"dataloader_kwargs": {"sampler": None}}, "remove 'sampler'"),
        ({"batch_size": 2, "dataloader_kwargs": {"batch_size": 2}}, "given both"),
        ({"checkpoint_interval": 0}, "checkpoint_interval must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused_before_any_batch(job, kwargs, message):
    with pytest.raises(ValueError, match=message):
        torch_batch_process(Linear, Numbers(8), **kwargs)
    assert Linear.calls == [] and not (job / "checkpoints").exists()


def test_an_iterable_dataset_is_refused_naming_the_fix(job):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="map-style"):
        torch_batch_process(Linear, Stream())


def test_determined_alias_serves_the_experimental_module():
    from det_tasks import compat

    assert compat.install()
    from determined.pytorch import experimental  # type: ignore[import-not-found]

    assert experimental.torch_batch_process is torch_batch_process
    assert experimental.TorchBatchProcessor is TorchBatchProcessor
    assert hasattr(experimental, "TorchBatchProcessorContext")
