"""No trial run is ever recorded COMPLETED before its searcher length is reached (or the
trial stopped itself early): ``ExperimentRuns.finish``, which every ending of a trial run
goes through, checks it (registry.runs.trial_states.honest_end).

Found before: a Dask scheduler restarted mid-experiment closed every worker, each worker's
plugin released its held trial as if it had finished, and two trials at batches 400 and 500
of 800 were recorded FINISHED / COMPLETED, never validated at 800."""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path
from typing import Any

import pytest

from det_tasks.runner.held import HeldTrial, TrialSpec
from registry.runs.tracking import END_REASON_TAG, ExperimentRuns
from registry.runs.trial_states import (
    COMPLETED,
    PAUSED,
    PRUNED,
    STOPPED,
    Progress,
    honest_end,
)

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn
    from det_tasks.pytorch import DataLoader, PyTorchTrial

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 40
        def __getitem__(self, i):
            x = torch.full((2,), float(i % 5))
            return x, x.sum(0, keepdim=True)

    class Line(PyTorchTrial):
        def __init__(self, context):
            self.context = context
            self.model = context.wrap_model(nn.Linear(2, 1))
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01))
        def build_training_data_loader(self):
            return DataLoader(Data(), batch_size=4)
        def build_validation_data_loader(self):
            return DataLoader(Data(), batch_size=8)
        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            if self.context.get_hparam("stop_at") == batch_idx + 1:
                self.context.set_stop_requested(True)
            return {"loss": loss}
        def evaluate_batch(self, batch):
            x, y = batch
            return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}
    """
)

CONFIG = textwrap.dedent(
    """
    name: invariant
    entrypoint: model_def:Line
    hyperparameters: {global_batch_size: 4, stop_at: 0}
    searcher: {name: single, metric: validation_loss, max_length: {batches: 20}}
    """
)


@pytest.mark.parametrize(
    ("progress", "ends"),
    [
        (None, PAUSED),  # nobody said how far it got: not a completion
        (Progress(400, 800), PAUSED),
        (Progress(800, 800), COMPLETED),
        (Progress(12, 800, stop_requested=True), COMPLETED),  # the trial stopped itself
        (Progress(5, None), PAUSED),
    ],
)
def test_completed_only_at_the_length(progress: Progress | None, ends: str) -> None:
    state, reason = honest_end(COMPLETED, progress)
    assert state == ends
    assert (reason is None) == (ends == COMPLETED)
    if progress is not None and ends == PAUSED:
        assert f"at batch {progress.trained} of" in str(reason)


@pytest.mark.parametrize("state", [STOPPED, PRUNED, "CANCELED", "ERROR", PAUSED])
def test_other_ends_are_kept(state: str) -> None:
    assert honest_end(state, None) == (state, None)


def _runs(client: Any, key: str) -> ExperimentRuns:
    return ExperimentRuns(client, "completed-invariant", key, {})


def test_finish_refuses_a_short_completion(
    mlflow_store: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path))
    client, _ = mlflow_store
    runs = _runs(client, "short")
    trial = runs.trial_run("1", {}, {})
    assert runs.finish(trial, "FINISHED", progress=Progress(400, 800)) == ("KILLED", PAUSED)
    run = client.get_run(trial)
    assert (run.info.status, run.data.tags["det.state"]) == ("KILLED", PAUSED)
    assert "at batch 400 of 800" in run.data.tags[END_REASON_TAG]
    # The experiment's own run is not a trial: its end is the flow's to decide.
    assert runs.finish(runs.parent_run_id, "FINISHED") == ("FINISHED", COMPLETED)


def _held(model: Path, key: str, stop_at: int = 0) -> HeldTrial:
    spec = TrialSpec(
        config_path=str(model / "config.yaml"),
        model_dir=str(model),
        overrides=(),
        trial_id=1,
        hparams={"global_batch_size": 4, "stop_at": stop_at},
        experiment_run_key=key,
    )
    return HeldTrial(spec)


@pytest.fixture
def platform(
    mlflow_store: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Path]:
    """A model folder, and the platform's services over a real (SQLite) MLflow store."""
    client, _ = mlflow_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(client.tracking_uri))
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("DET_TASKS_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_def.py").write_text(MODEL)
    (model / "config.yaml").write_text(CONFIG)
    return client, model


def _trial_run(client: Any, key: str) -> Any:
    experiment = client.get_experiment_by_name("invariant")
    (parent,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`det.experiment_run` = '{key}'"
    )
    (trial,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
    )
    return trial


@pytest.mark.parametrize(
    ("key", "train_to", "stop_at", "status", "state"),
    [
        # Released at 8 of 20 with no stop request: what a closing worker did.
        ("released-early", 8, 0, "KILLED", PAUSED),
        ("trained-out", 20, 0, "FINISHED", COMPLETED),
        # set_stop_requested at batch 6: Determined's early exit, a normal end.
        ("stopped-itself", 20, 6, "FINISHED", COMPLETED),
    ],
)
def test_a_held_trial_released_short_of_its_length_is_not_completed(
    platform: tuple[Any, Path], key: str, train_to: int, stop_at: int, status: str, state: str
) -> None:
    client, model = platform
    held = _held(model, key, stop_at)
    held.train_to(train_to)
    held.close()  # released with no error and no stop: it reads as a normal end
    run = _trial_run(client, key)
    assert (run.info.status, run.data.tags["det.state"]) == (status, state)
    assert (END_REASON_TAG in run.data.tags) == (state == PAUSED)


@pytest.mark.parametrize(
    ("ending", "parent_status", "parent_state"),
    [
        ("pause", "KILLED", PAUSED),  # `det-tasks run` stopped by SIGTERM or SIGHUP
        ("short", "KILLED", PAUSED),  # ended short of its length without a stop
        ("trained", "FINISHED", COMPLETED),
    ],
)
def test_a_lone_trial_ends_its_experiment_run_as_it_ended(
    platform: tuple[Any, Path], ending: str, parent_status: str, parent_state: str
) -> None:
    """``det-tasks run`` owns its experiment run: the parent says what its one trial says."""
    from det_tasks.errors import TrialStopped
    from registry.jobs.trial_services import trial_services

    client, model = platform
    name = f"lone-{ending}"
    with (
        contextlib.suppress(TrialStopped),
        trial_services(
            {"searcher": {"metric": "validation_loss"}}, {}, model_dir=model, experiment_name=name
        ) as services,
    ):
        services.metrics_sink.record_position(20 if ending == "trained" else 8, 20, False)
        if ending == "pause":
            raise TrialStopped(PAUSED)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert (parent.info.status, parent.data.tags.get("det.state")) == (
        parent_status,
        parent_state,
    )
