"""Checkpoint references stay inside what they name: a runs:/ path that climbs out of the
run's artifacts (plainly, percent-encoded, or absolute), a symbolic link out of a file-store
checkpoint, an s3:// URI that leaves the configured prefix: each is refused in one line
naming the reference, before anything is read or made. A missing ``--resume`` path is
reported as the path the user typed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the platform extra is not installed")

from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.errors import CheckpointError
from det_tasks.runner.cli import main
from det_tasks.runner.resume import choose_resume_checkpoint
from registry.checkpoints import uris
from registry.checkpoints.cache import fetch_checkpoint
from registry.servers.containment import key_within, normalised_key
from registry.servers.local_files import FileLocation
from registry.servers.s3 import artifact_location, parse_location

RUN = "0123456789abcdef"
TRAVERSALS = [
    f"runs:/{RUN}/checkpoints/../../../../../../outside",
    f"runs:/{RUN}/../checkpoints/good",
    f"runs:/{RUN}/checkpoints/%2e%2e/%2e%2e/%2E%2E/outside",
    f"runs:/{RUN}/checkpoints/%252e%252e/%252e%252e/%252e%252e/outside",
    f"runs:/{RUN}/checkpoints%2f..%2f..%2f..%2foutside",
    f"runs:/{RUN}//abs/outside",
    f"runs:/{RUN}/%2Fabs/outside",
]


def write_checkpoint(path: Path, payload: bytes = b"weights") -> Path:
    """A complete checkpoint: a state file and a metadata.json listing its checksum."""
    path.mkdir(parents=True)
    (path / "state_dict.pth").write_bytes(payload)
    files = {
        "state_dict.pth": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    }
    (path / "metadata.json").write_text(json.dumps({"format_version": 1, "files": files}))
    return path


class NoS3:
    """An S3 client that must not be called: the file store needs none, and a refused
    location must be refused before any request."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"S3 was called ({name}) for a refused or local location")


@pytest.fixture
def file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A run whose artifacts are a local directory holding one good checkpoint, with a
    checkpoint-looking folder outside it (the thing a traversal would steal); MLflow's
    client is a stand-in that knows the one run."""
    artifacts = tmp_path / "mlruns" / "1" / RUN / "artifacts"
    write_checkpoint(artifacts / "checkpoints" / "good")
    outside = write_checkpoint(tmp_path / "outside", b"not yours")
    (tmp_path / "abs").symlink_to(tmp_path)  # so /abs/outside would name a real checkpoint
    cache = tmp_path / "cache"
    run = SimpleNamespace(info=SimpleNamespace(artifact_uri=artifacts.as_uri()))
    client = SimpleNamespace(get_run=lambda run_id: run)
    monkeypatch.setattr(uris, "_client", lambda: client)
    monkeypatch.setenv("DET_TASKS_CACHE_DIR", str(cache))
    monkeypatch.delenv("DET_TASKS_MLFLOW_ARTIFACTS", raising=False)
    monkeypatch.delenv("DET_TASKS_ARTIFACT_ROOT", raising=False)
    monkeypatch.setattr("registry.servers.s3.client", lambda *a, **k: NoS3())
    return {"artifacts": artifacts, "outside": outside, "cache": cache, "root": tmp_path}


@pytest.mark.parametrize(
    ("key", "normal"),
    [
        ("a/b", "a/b"),
        ("/a//b/./c/", "a/b/c"),
        ("a/b/../c", "a/c"),
        ("a/../../x", "../x"),
        ("a/..", ""),
        ("//../x", "../x"),
    ],
)
def test_keys_normalise(key: str, normal: str) -> None:
    assert normalised_key(key) == normal


def test_key_within_its_root() -> None:
    assert key_within("art/run/checkpoints/x", "art/run")
    assert key_within("art/run", "art/run")
    assert not key_within("art/runner", "art/run")  # a sibling sharing the prefix's text
    assert not key_within("art/other", "art/run")
    assert not key_within("../x", "")  # above the bucket
    assert key_within("anything/at/all", "")


@pytest.mark.parametrize("uri", TRAVERSALS)
def test_runs_uri_leaving_the_artifact_root_is_refused_in_one_line(
    file_store: dict[str, Path], uri: str
) -> None:
    with pytest.raises(CheckpointError) as caught:
        uris.fetch_checkpoint_uri(uri)
    message = str(caught.value)
    assert message.startswith(repr(uri) + " leaves the run's artifact root")
    assert file_store["artifacts"].as_uri() in message
    assert "runs:/<run_id>/checkpoints/<uuid>" in message  # what a valid one looks like
    assert "\n" not in message
    assert not file_store["cache"].exists()  # nothing made, nothing read


def test_runs_uri_inside_the_artifact_root_still_resolves(file_store: dict[str, Path]) -> None:
    for uri in (
        f"runs:/{RUN}/checkpoints/good",
        f"runs:/{RUN}/checkpoints/../checkpoints/good/",
        f"runs:/{RUN}/checkpoints/%2e%2e/checkpoints/good",
    ):
        fetched = uris.fetch_checkpoint_uri(uri)
        assert (fetched / "state_dict.pth").read_bytes() == b"weights"


def test_symlink_out_of_a_file_store_checkpoint_is_refused(file_store: dict[str, Path]) -> None:
    leaky = write_checkpoint(file_store["artifacts"] / "checkpoints" / "leaky")
    (leaky / "extra.pth").symlink_to(file_store["outside"] / "state_dict.pth")
    with pytest.raises(CheckpointError, match=r"extra\.pth in it is a symbolic link to /"):
        uris.fetch_checkpoint_uri(f"runs:/{RUN}/checkpoints/leaky")
    linked = file_store["artifacts"] / "checkpoints" / "linked"
    linked.symlink_to(file_store["outside"], target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"leaves the run's artifact root.*resolves to"):
        uris.fetch_checkpoint_uri(f"runs:/{RUN}/checkpoints/linked")
    assert not file_store["cache"].exists()


def test_symlink_inside_the_artifact_root_is_not_an_escape(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    ckpt = write_checkpoint(root / "checkpoints" / "a")
    (ckpt / "alias.pth").symlink_to(ckpt / "state_dict.pth")
    base = FileLocation(root).bounded(artifact_location(root.as_uri(), None, "run").boundary)
    assert base.child("checkpoints/a").escape() is None


def test_s3_location_leaving_the_run_root_is_refused_before_any_request() -> None:
    base = artifact_location("mlflow-artifacts:/1/run/artifacts", "s3://bucket/mlflow", "run")
    assert base.uri == "s3://bucket/mlflow/1/run/artifacts"
    for relative in ("checkpoints/../../x", "checkpoints/%2e%2e/%2e%2e/x", "/mlflow/1/other"):
        location = base.child(relative)
        with pytest.raises(CheckpointError, match="leaves the run's artifact root"):
            fetch_checkpoint(NoS3(), location, Path("/nonexistent/cache"))
    assert base.child("checkpoints/../checkpoints/u").escape() is None
    assert base.child("checkpoints/u").prefix == "mlflow/1/run/artifacts/checkpoints/u"


def test_s3_uri_leaving_the_configured_prefix_or_bucket_is_refused(
    file_store: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_TASKS_MLFLOW_ARTIFACTS", "s3://bucket/mlflow")
    for uri in ("s3://bucket/mlflow/../secrets/ckpt", "s3://bucket/mlflow/1/%2e%2e/%2e%2e/x"):
        with pytest.raises(CheckpointError) as caught:
            uris.fetch_checkpoint_uri(uri)
        assert str(caught.value).startswith(
            f"{uri!r} leaves the configured prefix DET_TASKS_MLFLOW_ARTIFACTS (s3://bucket/mlflow)"
        )
    with pytest.raises(CheckpointError, match="leaves the bucket 'bucket'"):
        uris.fetch_checkpoint_uri("s3://bucket/a/../../other-bucket/x")
    # Outside the configured prefix but written plainly: a place the user chose, not refused.
    assert uris.checkpoint_location("s3://bucket/elsewhere/ckpt").escape() is None


def test_file_uri_leaving_the_configured_artifact_root_is_refused(
    file_store: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(file_store["root"] / "mlruns"))
    uri = (file_store["root"] / "mlruns").as_uri() + "/1/../../outside"
    with pytest.raises(CheckpointError, match="leaves the configured prefix DET_TASKS_ARTIFACT"):
        uris.fetch_checkpoint_uri(uri)
    assert not file_store["cache"].exists()


def test_parse_location_decodes_file_uris(tmp_path: Path) -> None:
    spaced = tmp_path / "a b"
    assert parse_location(spaced.as_uri()).path == spaced  # as_uri writes the space as %20


def test_download_of_a_traversal_creates_nothing(
    file_store: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(file_store["root"])
    code = main(["download", TRAVERSALS[0], "dl10/../dl11"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {TRAVERSALS[0]!r} leaves the run's artifact root")
    assert err.count("\n") == 1 and ".py:" not in err  # one line, no internal file:line
    assert not (file_store["root"] / "dl10").exists()
    assert not (file_store["root"] / "dl11").exists()


def test_download_destination_is_normalised_before_it_is_made(
    file_store: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(file_store["root"])
    assert main(["download", f"runs:/{RUN}/checkpoints/good", "dl10/../dl11"]) == 0
    assert capsys.readouterr().out.strip() == str(file_store["root"] / "dl11")
    assert (file_store["root"] / "dl11" / "state_dict.pth").read_bytes() == b"weights"
    assert not (file_store["root"] / "dl10").exists()
    assert not [p for p in file_store["root"].iterdir() if p.name.startswith(".dl11")]


def test_missing_resume_path_names_what_the_user_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalDirectoryStore(tmp_path / "store")
    monkeypatch.chdir(tmp_path)
    for typed in ("./nope", "../nope", "nope/x", "~/no-such-det-tasks-checkpoint"):
        with pytest.raises(CheckpointError) as caught:
            choose_resume_checkpoint(store, typed)
        assert str(caught.value).startswith(f"checkpoint path {typed!r} does not exist")
    both_missing = r"(?s)no intact checkpoint.*'\./nope' does not exist"
    with pytest.raises(CheckpointError, match=both_missing):
        choose_resume_checkpoint(store, ["./nope", "./gone"])
    write_checkpoint(tmp_path / "here")
    assert choose_resume_checkpoint(store, "./here") == "./here"  # a path that exists
    assert choose_resume_checkpoint(store, "a-uuid") == "a-uuid"  # looked up by the store


def test_resume_from_a_missing_path_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model" / "killable.yaml"
    argv = ["run", str(config), "--no-progress", "--checkpoint-dir", "ckpts", "--resume", "./nope"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: checkpoint path './nope' does not exist"), err
    assert err.count("\n") == 1 and ".py:" not in err
