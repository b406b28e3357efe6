"""``checkpoint_storage``'s folder without servers (issue 50, item 6): the embedded flow
keeps checkpoints under ``host_path`` as ``det-tasks run`` does, by making it the artifact
root of the experiments it creates, and says so in one line; where a setting of the user's
wins, the line says the field is not used and why. No field is silently ignored."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from det_tasks.config.loader import parse_config
from det_tasks.errors import ConfigError
from flows.embedded import honour_checkpoint_folder


def _config(storage: dict[str, Any] | None) -> Any:
    raw: dict[str, Any] = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 4},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 2}},
    }
    if storage is not None:
        raw["checkpoint_storage"] = storage
    return parse_config(raw)


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DET_TASKS_ARTIFACT_ROOT", raising=False)
    return monkeypatch


def test_host_path_becomes_the_artifact_root(no_settings: Any, tmp_path: Path) -> None:
    line = honour_checkpoint_folder(_config({"type": "shared_fs", "host_path": str(tmp_path)}))
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path.resolve())
    assert line is not None and "\n" not in line
    assert f"checkpoints go under {tmp_path.resolve()}" in line
    assert "checkpoint_storage.host_path" in line


def test_storage_path_and_container_path_count_too(no_settings: Any, tmp_path: Path) -> None:
    storage = {"type": "shared_fs", "host_path": str(tmp_path), "storage_path": "ckpts"}
    line = honour_checkpoint_folder(_config(storage))
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path.resolve() / "ckpts")
    assert line is not None and "host_path + storage_path" in line
    no_settings.delenv("DET_TASKS_ARTIFACT_ROOT")
    honour_checkpoint_folder(_config({"type": "directory", "container_path": str(tmp_path)}))
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path.resolve())


def test_a_relative_host_path_is_the_working_directorys(no_settings: Any, tmp_path: Path) -> None:
    no_settings.chdir(tmp_path)
    honour_checkpoint_folder(_config({"type": "shared_fs", "host_path": "out"}))
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path.resolve() / "out")


def test_the_users_artifact_root_wins_and_the_line_says_so(
    no_settings: Any, tmp_path: Path
) -> None:
    no_settings.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path / "mine"))
    line = honour_checkpoint_folder(
        _config({"type": "shared_fs", "host_path": str(tmp_path / "cfg")})
    )
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path / "mine")
    assert line is not None and "is not used" in line and "DET_TASKS_ARTIFACT_ROOT" in line


def test_a_tracking_server_wins_and_the_line_says_so(no_settings: Any, tmp_path: Path) -> None:
    no_settings.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5001")
    line = honour_checkpoint_folder(_config({"type": "shared_fs", "host_path": str(tmp_path)}))
    assert "DET_TASKS_ARTIFACT_ROOT" not in os.environ
    assert line is not None and "is not used" in line and "MLFLOW_TRACKING_URI" in line


def test_an_unwritable_folder_is_refused_naming_the_field(no_settings: Any, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"`checkpoint_storage.host_path` = .* cannot hold"):
        honour_checkpoint_folder(
            _config({"type": "shared_fs", "host_path": str(tmp_path / "file" / "x")})
        )
    assert "DET_TASKS_ARTIFACT_ROOT" not in os.environ


def test_the_embedded_defaults_are_not_the_users_choice(no_settings: Any, tmp_path: Path) -> None:
    """Called after use_embedded_defaults (or the warm services' attach), the home's own
    store and artifact folder do not count as the user's settings."""
    from det_tasks.home import det_tasks_home, no_server_recording

    no_settings.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    for name, value in no_server_recording(det_tasks_home()).items():
        no_settings.setenv(name, value)
    line = honour_checkpoint_folder(_config({"type": "shared_fs", "host_path": str(tmp_path)}))
    assert os.environ["DET_TASKS_ARTIFACT_ROOT"] == str(tmp_path.resolve())
    assert line is not None and line.startswith("checkpoints go under")


@pytest.mark.parametrize("storage", [None, {"type": "s3", "bucket": "det-tasks"}])
def test_no_folder_no_line(no_settings: Any, storage: Any) -> None:
    assert honour_checkpoint_folder(_config(storage)) is None
    assert "DET_TASKS_ARTIFACT_ROOT" not in os.environ
