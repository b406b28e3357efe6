"""Model packages: .detignore, deterministic bytes, the size limit, and refusal of unsafe
archives (path traversal, absolute paths, links)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from det_tasks.checkpoints.model_package import PackageError, pack_model_dir, unpack_model_package
from det_tasks.config.job import load_job_config
from det_tasks.errors import ConfigError


def make_dir(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "model_def.py").write_text("X = 1\n")
    (root / "pkg" / "util.py").write_text("Y = 2\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 1000)
    (root / "notes.log").write_text("log")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "m.pyc").write_bytes(b"pyc")
    (root / ".detignore").write_text("data/\n*.log\n!keep.log\n")
    (root / "keep.log").write_text("kept")
    return root


def test_detignore_and_defaults_leave_files_out(tmp_path):
    packed = pack_model_dir(make_dir(tmp_path / "m"))
    assert packed.files == [".detignore", "keep.log", "model_def.py", "pkg/util.py"]
    out = unpack_model_package(_write(tmp_path, packed.data), tmp_path / "out")
    assert (out / "pkg" / "util.py").read_text() == "Y = 2\n"
    assert not (out / "data").exists()


def test_identical_content_gives_identical_bytes(tmp_path):
    a = pack_model_dir(make_dir(tmp_path / "a"))
    b = pack_model_dir(make_dir(tmp_path / "b"))  # other path, other mtimes
    assert a.sha256 == b.sha256 and a.data == b.data
    (tmp_path / "b" / "model_def.py").write_text("X = 3\n")
    assert pack_model_dir(tmp_path / "b").sha256 != a.sha256


def test_size_limit_names_the_largest_files(tmp_path):
    root = make_dir(tmp_path / "m")
    (root / "weights.pt").write_bytes(b"w" * 3000)
    with pytest.raises(PackageError, match=r"largest files: weights\.pt \(0\.0 MB\)"):
        pack_model_dir(root, max_bytes=2000)


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "archive.tar.gz"
    path.write_bytes(data)
    return path


def _archive(tmp_path: Path, member: tarfile.TarInfo, body: bytes = b"") -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        member.size = len(body) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(body) if member.isfile() else None)
    return _write(tmp_path, raw.getvalue())


@pytest.mark.parametrize("name", ["../evil.py", "/etc/evil.py", "a/../../evil.py"])
def test_paths_outside_the_folder_are_refused(tmp_path, name):
    archive = _archive(tmp_path, tarfile.TarInfo(name), b"boom")
    with pytest.raises(PackageError, match="outside its folder"):
        unpack_model_package(archive, tmp_path / "out")
    assert not (tmp_path / "evil.py").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_links_are_refused(tmp_path, kind):
    member = tarfile.TarInfo("link")
    member.type = kind
    member.linkname = "/etc/passwd"
    with pytest.raises(PackageError, match="link or special file"):
        unpack_model_package(_archive(tmp_path, member), tmp_path / "out")


def test_truncated_archive_is_refused_by_name(tmp_path):
    packed = pack_model_dir(make_dir(tmp_path / "m"))
    archive = _write(tmp_path, packed.data[: len(packed.data) // 2])
    with pytest.raises(PackageError, match=r"archive\.tar\.gz.*unreadable"):
        unpack_model_package(archive, tmp_path / "out")


def test_job_config_forms(tmp_path):
    script = tmp_path / "job.yaml"
    script.write_text("entrypoint_script: python3 batch_inference.py\ndata: {trial_id: 7}\n")
    _, job = load_job_config(script)
    assert job.script == "python3 batch_inference.py" and job.data == {"trial_id": 7}
    builtin = tmp_path / "builtin.yaml"
    builtin.write_text("data: {model_uri: 'models:/m@champion', num_shards: 2}\n")
    assert load_job_config(builtin)[1].script is None
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("data: {model_uri: 'models:/m@champion', trial_id: 3}\n")
    with pytest.raises(ConfigError, match=r"\['trial_id'\].*entrypoint_script"):
        load_job_config(wrong)
    empty = tmp_path / "empty.yaml"
    empty.write_text("data: {}\n")
    with pytest.raises(ConfigError, match="nothing to run"):
        load_job_config(empty)


def test_credentials_stay_out_of_packages_and_checkpoint_code(tmp_path: Path) -> None:
    from det_tasks.checkpoints.format import copy_code

    model = tmp_path / "model"
    (model / ".ssh").mkdir(parents=True)
    (model / "sub").mkdir()
    (model / "model_def.py").write_text("x = 1\n")
    (model / "sub" / "util.py").write_text("y = 2\n")
    secrets = [".env", "sub/.env.local", "server.pem", "tls.key", ".ssh/id_rsa", ".netrc"]
    for name in secrets:
        (model / name).write_text("planted-secret\n")
    packed = pack_model_dir(model)
    assert sorted(packed.files) == ["model_def.py", "sub/util.py"]
    dest = tmp_path / "ckpt"
    dest.mkdir()
    copy_code(model, dest)
    copied = sorted(p.relative_to(dest / "code").as_posix() for p in dest.rglob("*") if p.is_file())
    assert copied == ["model_def.py", "sub/util.py"]
