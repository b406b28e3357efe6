"""Auxiliary writes never fail training: a TensorBoard (or profiler) file that cannot be
uploaded, even with an error that does not pickle (boto3's, holding the open file), is
retried, then dropped with one warning while the trial trains to its end; a system-metrics
sample that cannot be logged is dropped with one warning per run; and whatever a step raises
crosses Dask's process boundary as an exception the flow can read."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

from cluster.step_errors import crossing_error
from det_tasks.errors import StepFailed
from registry.metrics import tensorboard_upload
from registry.metrics.system_metrics import start_system_metrics
from registry.runs.tracking import client_for
from registry.servers.settings import RegistrySettings

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"


class _UploadFailed(Exception):
    """Like botocore's S3UploadFailedError from upload_file: it holds the file it read."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"Failed to upload {path}: An error occurred (SlowDown)")
        self.body = open(path, "rb")  # noqa: SIM115 - held, as boto3's error holds it


def _unpicklable_error(tmp_path: Path) -> _UploadFailed:
    body = tmp_path / "events.out.tfevents.1"
    body.write_bytes(b"event")
    return _UploadFailed(body)


def test_an_unpicklable_error_crosses_the_step_boundary_as_plain_text(tmp_path: Path) -> None:
    err = _unpicklable_error(tmp_path)
    with pytest.raises(TypeError, match="cannot pickle"):
        pickle.dumps(err)
    plain = crossing_error(err)
    assert type(plain) is RuntimeError
    assert str(plain) == f"_UploadFailed: {err}"
    assert str(pickle.loads(pickle.dumps(plain))) == str(plain)
    failed = StepFailed(1, "train_batch", 3, "ValueError: x")
    assert crossing_error(failed) is failed  # already plain data: unchanged


def test_a_failed_tensorboard_upload_is_retried_then_dropped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "tb"
    folder.mkdir()
    (folder / "events.out.tfevents.1").write_bytes(b"event")
    calls: list[str] = []

    class Client:
        def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str) -> None:
            calls.append(artifact_path)
            raise _unpicklable_error(tmp_path)

    with caplog.at_level(logging.WARNING, logger=tensorboard_upload.__name__):
        assert tensorboard_upload.upload_tensorboard(Client(), "run-1", folder) is False
    assert calls == ["tensorboard"] * tensorboard_upload.ATTEMPTS
    warnings = [r for r in caplog.records if r.name == tensorboard_upload.__name__]
    assert len(warnings) == 1
    assert "run-1" in warnings[0].getMessage() and "SlowDown" in warnings[0].getMessage()
    assert not folder.exists()


def test_training_goes_on_when_its_tensorboard_files_cannot_be_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A trial on a real MLflow store (SQLite, local artifacts) whose TensorBoard upload
    fails on every try with an unpicklable error: it trains all its batches, checkpoints,
    its run ends FINISHED, and the user reads one warning."""
    pytest.importorskip("tensorboard")
    from mlflow import MlflowClient

    from det_tasks.runner.in_process import run_trial

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("DET_TASKS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    real = MlflowClient.log_artifacts
    attempts: list[int] = []

    def log_artifacts(self: Any, run_id: str, local_dir: str, artifact_path: Any = None) -> None:
        if artifact_path == "tensorboard":
            attempts.append(len(list(Path(local_dir).rglob("*.tfevents.*"))))
            raise _unpicklable_error(tmp_path)
        real(self, run_id, local_dir, artifact_path)

    monkeypatch.setattr(MlflowClient, "log_artifacts", log_artifacts)
    with caplog.at_level(logging.WARNING):
        result = run_trial(
            FLOW_MODEL / "killable.yaml",
            FLOW_MODEL,
            overrides=["hyperparameters.sleep_s=0"],
            progress=False,
            max_batches=40,
        )
    assert result.batches_trained == 40 and result.checkpoint_uuid is not None
    assert attempts == [1] * tensorboard_upload.ATTEMPTS  # event files were there to send
    dropped = [r for r in caplog.records if r.name == tensorboard_upload.__name__]
    assert len(dropped) == 1
    run = client_for(uri).search_runs(
        [e.experiment_id for e in client_for(uri).search_experiments()],
        filter_string="tags.`mlflow.parentRunId` != ''",
    )
    assert [r.info.status for r in run] == ["FINISHED"]


def test_system_metrics_samples_that_cannot_be_logged_warn_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RegistrySettings(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        s3_endpoint=None,
        bucket=None,
        artifacts_destination=None,
        cache_dir=tmp_path,
        system_metrics_interval=30.0,
    )
    assert settings.tracking_uri is not None
    client = client_for(settings.tracking_uri)
    run_id = client.create_run(client.create_experiment("sampled")).info.run_id
    sampler = start_system_metrics(settings, run_id)
    assert sampler is not None
    monitor = sampler._monitor

    def refuse(metrics: dict[str, float]) -> None:
        raise _unpicklable_error(tmp_path)

    monitor.publish_metrics = refuse
    with caplog.at_level(logging.WARNING, logger="registry.metrics.system_metrics"):
        assert [monitor.sample() for _ in range(3)] == [False, False, False]
        sampler.finish()  # its last sample fails too, and says nothing more
    assert sampler.failures == 4
    warnings = [r for r in caplog.records if r.name == "registry.metrics.system_metrics"]
    assert len(warnings) == 1 and run_id in warnings[0].getMessage()
