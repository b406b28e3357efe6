"""An experiment runs its own code (issue 50, item 2) and a failed activate changes nothing
(issue 49, item 5): the snapshot taken at creation, what differs on disk, the explicit
opt-in to changed code recorded as a new code version, and runs put back PAUSED. The
MLflow store is real (SQLite); the flow's use of these is tested in
tests/integration/test_code_snapshot_flow.py."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from det_tasks.pytorch._loop.restore import load_model_weights
from registry.experiments.activation import (
    ACTIVATION_ERROR_TAG,
    activation_progressed,
    back_to_paused,
    before_activation,
)
from registry.experiments.code import adopt_code, code_for_start, code_verdict
from registry.experiments.code_snapshot import (
    CODE_HISTORY_TAG,
    CODE_VERSION_TAG,
    SNAPSHOT_TAG,
    changed_files,
    code_version,
    open_snapshot,
    take_snapshot,
)
from registry.runs.tracking import ERROR_TAG, STATE_TAG, ExperimentRuns


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DET_TASKS_S3_BUCKET", raising=False)
    return tmp_path / "home"


def _model(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "model_def.py").write_text("WIDTH = 6\n")
    (root / "util.py").write_text("X = 1\n")
    return root


def test_a_local_snapshot_is_kept_in_the_home_and_reopened_by_its_uri(home, tmp_path):
    model = _model(tmp_path / "model")
    snapshot = take_snapshot(model)
    assert Path(snapshot.uri).parent == home / "code"
    assert Path(snapshot.uri).name.endswith(".tar.gz")
    assert (snapshot.folder / "model_def.py").read_text() == "WIDTH = 6\n"
    (model / "model_def.py").write_text("WIDTH = 8\n")  # the folder moves on
    again = open_snapshot(snapshot.uri)
    assert again == snapshot
    assert (again.folder / "model_def.py").read_text() == "WIDTH = 6\n"
    shutil.rmtree(snapshot.folder)  # a host without the unpacked copy unpacks it again
    assert (open_snapshot(snapshot.uri).folder / "model_def.py").read_text() == "WIDTH = 6\n"


def test_changed_files_names_each_file_and_how(home, tmp_path):
    model = _model(tmp_path / "model")
    snapshot = take_snapshot(model)
    assert changed_files(snapshot, model) == []
    (model / "pkg" / "a-b").mkdir(parents=True)  # "/" and "-" sort apart as text and as paths
    (model / "pkg" / "a-b" / "c.py").write_text("")
    (model / "pkg" / "a").mkdir()
    (model / "pkg" / "a" / "b.py").write_text("")
    snapshot = take_snapshot(model)
    assert snapshot.version == code_version(snapshot.folder)  # the trial runs' hash
    (snapshot.folder / "outputs.txt").write_text("a trial wrote beside its code")
    assert changed_files(snapshot, model) == []
    (model / "model_def.py").write_text("WIDTH = 8\n")
    (model / "util.py").unlink()
    (model / "extra.py").write_text("")
    (model / "__pycache__").mkdir()
    (model / "__pycache__" / "x.pyc").write_bytes(b"")  # never code: no difference
    assert changed_files(snapshot, model) == [
        "extra.py added",
        "model_def.py changed",
        "util.py removed",
    ]


def _experiment(client: Any, name: str) -> ExperimentRuns:
    return ExperimentRuns(client, name, str(uuid.uuid4()), {"searcher": {"metric": "loss"}})


def test_a_resumed_experiment_runs_its_snapshot_and_says_what_differs(home, tmp_path, mlflow_store):
    client, _ = mlflow_store
    model = _model(tmp_path / "model")
    key = str(uuid.uuid4())
    first = code_for_start(client, key, model, (), use_changed_code=False)  # before its runs
    runs = ExperimentRuns(client, "snapshot-resume", key, {"searcher": {"metric": "loss"}})
    assert first.recorded is None and first.note is None
    adopt_code(client, runs.parent_run_id, first)
    tags = client.get_run(runs.parent_run_id).data.tags
    assert tags[SNAPSHOT_TAG] == first.snapshot.uri
    assert tags[CODE_VERSION_TAG] == first.snapshot.version
    (model / "model_def.py").write_text("WIDTH = 8\n")
    resumed = code_for_start(client, key, model, (), use_changed_code=False)
    assert resumed.snapshot == first.snapshot and not resumed.changed
    assert resumed.note is not None and "\n" not in resumed.note
    assert "model_def.py changed" in resumed.note
    assert "--use-changed-code" in resumed.note
    assert "did not change" in code_verdict(resumed)
    assert "model_def.py changed) were not used" in code_verdict(resumed)


def test_the_opt_in_records_a_new_code_version_on_every_run(home, tmp_path, mlflow_store):
    client, _ = mlflow_store
    model = _model(tmp_path / "model")
    key = str(uuid.uuid4())
    first = code_for_start(client, key, model, (), use_changed_code=False)
    runs = ExperimentRuns(client, "snapshot-opt-in", key, {"searcher": {"metric": "loss"}})
    adopt_code(client, runs.parent_run_id, first)
    trial = runs.trial_run("1", {"x": 1}, {CODE_VERSION_TAG: first.snapshot.version})
    (model / "model_def.py").write_text("WIDTH = 8\n")
    changed = code_for_start(client, key, model, (), use_changed_code=True)
    assert changed.changed and changed.recorded == first.snapshot
    assert (changed.snapshot.folder / "model_def.py").read_text() == "WIDTH = 8\n"
    assert "code changed since it was paused" in code_verdict(changed)
    adopt_code(client, runs.parent_run_id, changed)
    for run_id in (runs.parent_run_id, trial):
        tags = client.get_run(run_id).data.tags
        assert tags[CODE_VERSION_TAG] == changed.snapshot.version
        assert tags[CODE_HISTORY_TAG] == f"{first.snapshot.version} {changed.snapshot.version}"
    assert client.get_run(runs.parent_run_id).data.tags[SNAPSHOT_TAG] == changed.snapshot.uri


def _paused(client: Any, runs: ExperimentRuns) -> str:
    trial = runs.trial_run("1", {"x": 1}, {})
    client.log_metric(trial, "progress/batches", 40, step=40)
    client.set_tag(trial, "det.checkpoint.abc", "{}")
    for run_id in (runs.parent_run_id, trial):
        client.set_tag(run_id, STATE_TAG, "PAUSED")
        client.set_terminated(run_id, status="KILLED")
    return trial


def test_a_failed_activation_puts_every_run_back_as_it_was(mlflow_store):
    client, _ = mlflow_store
    runs = _experiment(client, "failed-activation")
    trial = _paused(client, runs)
    before = before_activation(client, runs.experiment_id, runs.parent_run_id)
    assert {b.run_id for b in before} == {runs.parent_run_id, trial}
    # what a failed activation leaves: runs RUNNING again, then ended FAILED/ERROR
    for run_id in (runs.parent_run_id, trial):
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, ERROR_TAG, "trial 1 failed in setup at batch 40: ...")
        client.set_tag(run_id, STATE_TAG, "ERROR")
        client.set_terminated(run_id, status="FAILED")
    client.set_tag(runs.parent_run_id, CODE_VERSION_TAG, "new")
    assert not activation_progressed(client, before)
    back_to_paused(client, before, "size mismatch for 0.weight")
    for run_id in (runs.parent_run_id, trial):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags[STATE_TAG] == "PAUSED"
        assert ERROR_TAG not in run.data.tags
        assert run.data.tags[ACTIVATION_ERROR_TAG] == "size mismatch for 0.weight"
    assert CODE_VERSION_TAG not in client.get_run(runs.parent_run_id).data.tags


def test_an_activation_that_trained_on_is_not_put_back(mlflow_store):
    client, _ = mlflow_store
    runs = _experiment(client, "activation-progressed")
    trial = _paused(client, runs)
    before = before_activation(client, runs.experiment_id, runs.parent_run_id)
    client.log_metric(trial, "progress/batches", 50, step=50)
    assert activation_progressed(client, before)


def test_a_weights_mismatch_prints_every_line_of_torchs_message():
    """Issue 49: the size mismatch itself was cut off, and a guess at hyperparameters took
    its place."""
    old = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    new = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with pytest.raises(Exception) as failed:
        load_model_weights(new, old.state_dict())
    lines = str(failed.value).splitlines()
    assert lines[0].startswith("the checkpoint's model weights do not fit Sequential:")
    assert lines[1:] == [
        "  size mismatch for 0.weight: copying a param with shape torch.Size([6, 2]) from "
        "checkpoint, the shape in current model is torch.Size([8, 2]).",
        "  size mismatch for 0.bias: copying a param with shape torch.Size([6]) from "
        "checkpoint, the shape in current model is torch.Size([8]).",
        "  size mismatch for 2.weight: copying a param with shape torch.Size([1, 6]) from "
        "checkpoint, the shape in current model is torch.Size([1, 8]).",
    ]
    assert "hyperparameters" not in str(failed.value)


def test_the_opt_in_is_refused_without_an_experiment_to_resume():
    from flows.command_line import check_command_line as _check_command_line

    config = str(Path(__file__).resolve().parents[1] / "fixtures" / "flow_model" / "killable.yaml")
    with pytest.raises(ValueError, match=r"--use-changed-code .* give it with --activate KEY"):
        _check_command_line([config, "--use-changed-code"])


def test_a_submitted_package_is_the_experiments_snapshot(home, tmp_path, mlflow_store):
    """det experiment create's package: recorded once; resuming with it changes nothing and
    a failed activation says the code did not change."""
    from registry.experiments.code import package_code

    client, _ = mlflow_store
    model = _model(tmp_path / "unpacked")
    runs = _experiment(client, "submitted-package")
    code = package_code("s3://det-tasks/packages/abc.tar.gz", model)
    adopt_code(client, runs.parent_run_id, code)
    tags = client.get_run(runs.parent_run_id).data.tags
    assert tags[SNAPSHOT_TAG] == "s3://det-tasks/packages/abc.tar.gz"
    assert tags[CODE_HISTORY_TAG] == code.snapshot.version
    adopt_code(client, runs.parent_run_id, package_code(code.snapshot.uri, model))
    assert client.get_run(runs.parent_run_id).data.tags[CODE_HISTORY_TAG] == code.snapshot.version
    assert "did not change since it was paused" in code_verdict(code)
