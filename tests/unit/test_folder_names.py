"""Folders made from experiment names stay inside their root (det_tasks.folder_names):
``../../../escaped-exp`` once put an experiment's checkpoints outside
``~/.det_tasks/artifacts``; ``a/b`` made nested folders; a 300-character name failed as
"File name too long" after training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from det_tasks.errors import ConfigError
from det_tasks.folder_names import MAX_FOLDER_NAME_BYTES, folder_name, folder_under
from registry.runs.tracking import ensure_experiment, experiment_artifact_location

NAMES = [
    "../../../escaped-exp",
    "a/b",
    "a_b",
    "a:b",
    "a b",
    "x" * 300,
    "x" * 300 + "y",
    "..",
    ".",
    ".hidden",
    "-rf",
    "nul\x00byte",
    "实验 一",
    "é" * 200,
]


@pytest.mark.parametrize("name", NAMES)
def test_a_folder_name_is_one_safe_bounded_component(name: str) -> None:
    folder = folder_name(name)
    assert "/" not in folder and "\\" not in folder and "\x00" not in folder
    assert folder not in (".", "..") and not folder.startswith((".", "-"))
    assert 13 < len(folder.encode("utf-8")) <= MAX_FOLDER_NAME_BYTES
    assert folder == folder_name(name)  # the same name finds the same folder again


def test_names_that_differ_only_in_unsafe_characters_get_different_folders() -> None:
    folders = {folder_name(name) for name in NAMES}
    assert len(folders) == len(NAMES)
    assert folder_name("a/b").startswith("a_b-") and folder_name("a_b").startswith("a_b-")


def test_the_readable_part_keeps_the_name_where_it_is_safe() -> None:
    assert folder_name("mnist-const_v1.2").startswith("mnist-const_v1.2-")
    assert folder_name("../../../escaped-exp").startswith("escaped-exp-")


@pytest.mark.parametrize("name", NAMES)
def test_every_folder_resolves_under_the_root(tmp_path: Path, name: str) -> None:
    root = tmp_path / "artifacts"
    assert folder_under(root, name).parent == root.resolve()
    location = experiment_artifact_location(str(root), name)
    assert location == folder_under(root, name).as_uri()


def test_a_link_planted_at_the_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    (root / folder_name("exp")).symlink_to(tmp_path)
    with pytest.raises(ConfigError, match=r"resolves to .* outside it: remove the link"):
        folder_under(root, "exp")


@pytest.mark.parametrize("name", NAMES)
def test_an_s3_root_keeps_every_experiment_under_its_prefix(name: str) -> None:
    location = experiment_artifact_location("s3://bucket/det/artifacts/", name)
    assert location == f"s3://bucket/det/artifacts/{folder_name(name)}"


def test_an_artifact_root_of_another_scheme_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="give a folder or an s3://bucket/prefix"):
        experiment_artifact_location("gs://bucket/x", "exp")


def test_a_new_experiment_keeps_its_artifacts_under_the_root(
    mlflow_store: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through MLflow: the experiment's artifact_location as recorded, for the name that
    escaped before."""
    client, _ = mlflow_store
    root = tmp_path / "home" / "artifacts"
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(root))
    for name in ("../../../escaped-exp", "a/b", "x" * 300):
        experiment = client.get_experiment(ensure_experiment(client, name))
        assert experiment.name == name
        assert experiment.artifact_location == (root.resolve() / folder_name(name)).as_uri()


@pytest.mark.parametrize("job_id", ["../x", "a/b", ".hidden", "", "x" * 129, "tab\tid"])
def test_a_job_id_that_would_leave_the_jobs_folder_is_refused(job_id, monkeypatch):
    from det_tasks.pytorch.experimental._job_services import JOB_ID_ENV, default_job_id

    monkeypatch.setenv(JOB_ID_ENV, job_id)
    if not job_id:  # unset: a fresh id
        assert default_job_id().startswith("job-")
        return
    with pytest.raises(ConfigError, match=f"{JOB_ID_ENV}=.* is not a usable id"):
        default_job_id()


def test_a_safe_job_id_is_kept(monkeypatch):
    from det_tasks.pytorch.experimental._job_services import JOB_ID_ENV, default_job_id

    monkeypatch.setenv(JOB_ID_ENV, "job-7.resume_2")
    assert default_job_id() == "job-7.resume_2"


def test_a_job_id_with_a_nul_is_refused_where_the_job_folder_is_named():
    from registry.jobs.batch_jobs import job_output_uri

    with pytest.raises(ConfigError, match=r"^the job id=.* is not a usable id") as caught:
        job_output_uri("nul\0")
    assert repr("nul\0") in str(caught.value)
