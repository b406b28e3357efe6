"""The model definition holds only code (issue 50, item 3): with the home inside the model
folder every checkpoint's ``code/`` held MLflow's and Prefect's databases (13 files,
5.7 MB), and once a checkpoint failed on a staging folder that vanished under the copy.
Packages (snapshots) and checkpoints' ``code/`` copies follow one rule: ``.detignore``
(gitignore syntax), never a home, database, cache or checkpoint, Determined's 95 MB limit."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from det_tasks.checkpoints import code_selection
from det_tasks.checkpoints import model_package as package_module
from det_tasks.checkpoints.code_selection import MAX_MODEL_DEF_BYTES, model_files
from det_tasks.checkpoints.format import copy_code
from det_tasks.checkpoints.model_package import PackageError, pack_model_dir
from det_tasks.errors import CheckpointError

CODE = ["const.yaml", "model_def.py", "pkg/layers.py"]


def _code(model: Path) -> Path:
    (model / "pkg").mkdir(parents=True)
    (model / "model_def.py").write_text("import torch\n")
    (model / "const.yaml").write_text("name: x\n")
    (model / "pkg" / "layers.py").write_text("WIDTH = 8\n")
    return model


def _sqlite(path: Path, wal: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    if wal:
        db.execute("pragma journal_mode=wal")
    db.execute("create table t (x)")
    db.execute("insert into t values (1)")
    db.commit()
    if wal:  # leave the -wal and -shm files there, as a live server does
        return
    db.close()


def _copied(model: Path, tmp_path: Path) -> list[str]:
    dest = tmp_path / "staged" / "ckpt-1"
    dest.mkdir(parents=True)
    copy_code(model, dest)
    return sorted(p.relative_to(dest / "code").as_posix() for p in dest.rglob("*") if p.is_file())


def test_a_home_inside_the_model_folder_stays_out(tmp_path, monkeypatch):
    """The case found: HOME inside a copy of an example, the platform's homes in it."""
    model = _code(tmp_path / "model")
    home = model / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DET_TASKS_HOME", str(home / ".det_tasks"))
    monkeypatch.setenv("PREFECT_HOME", str(home / "prefect"))
    monkeypatch.delenv("DET_TASKS_CACHE_DIR", raising=False)
    _sqlite(home / ".det_tasks" / "mlflow.db")
    (home / ".det_tasks" / "mlflow.db.lock").write_text("")
    (home / ".det_tasks" / "signing.key").write_text("secret")
    _sqlite(home / "prefect" / "prefect.db", wal=True)
    assert (home / "prefect" / "prefect.db-wal").exists()
    (home / "prefect" / "profiles.toml").write_text("")
    staged = home / ".cache" / "det_tasks" / "published" / "0b8c"
    staged.mkdir(parents=True)
    (staged / "state_dict.pth").write_bytes(b"w" * 100)
    (home / ".bash_history").write_text("ls\n")
    assert pack_model_dir(model).files == CODE
    assert _copied(model, tmp_path) == CODE


def test_the_named_homes_are_left_out_under_any_name_and_at_any_depth(tmp_path, monkeypatch):
    model = _code(tmp_path / "model")
    monkeypatch.setenv("DET_TASKS_HOME", str(model / "state" / "det"))
    monkeypatch.setenv("PREFECT_HOME", str(model / "state" / "pf"))
    for name in ["state/det/artifacts/a.txt", "state/pf/storage/x.json", "sub/.stack/env"]:
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text("platform")
    for name in ["sub/.det_tasks/x", "sub/.prefect/y", "deep/er/.cache/z", "pkg/__pycache__/a"]:
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text("platform")
    assert pack_model_dir(model).files == CODE


def test_sqlite_databases_are_known_by_their_header_with_their_sidecars(tmp_path):
    model = _code(tmp_path / "model")
    _sqlite(model / "data" / "records.bin", wal=True)  # a database under another name
    assert (model / "data" / "records.bin-wal").exists()
    (model / "data" / "records.bin.lock").write_text("")
    _sqlite(model / "runs.sqlite3")
    (model / "old.db-journal").write_text("j")
    (model / "data" / "labels.csv").write_text("a,b\n")  # data, not a database: kept
    assert sorted(pack_model_dir(model).files) == sorted([*CODE, "data/labels.csv"])


def test_checkpoint_folders_are_left_out_wherever_they_sit(tmp_path):
    model = _code(tmp_path / "model")
    for folder in ["outputs/run-3/0b8c", "determined_ckpt"]:
        (model / folder).mkdir(parents=True)
        (model / folder / "state_dict.pth").write_bytes(b"w")
        (model / folder / "load_data.json").write_text("{}")
    (model / "weights").mkdir()
    (model / "weights" / "state_dict.pth").write_bytes(b"w")  # a lone file: kept
    assert "weights/state_dict.pth" in pack_model_dir(model).files
    assert not any(f.startswith(("outputs/", "determined_ckpt/")) for f in _copied(model, tmp_path))


def test_detignore_has_gitignore_syntax(tmp_path):
    model = _code(tmp_path / "model")
    files = {
        "data/train.bin": "x",
        "data/schema.json": "{}",
        "notes.log": "log",
        "keep.log": "kept",
        "outputs/a.txt": "o",
        "pkg/outputs/b.txt": "o",
        "build/x.txt": "b",
        "pkg/build/y.txt": "b",
    }
    for name, text in files.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text(text)
    (model / ".detignore").write_text(
        "# data stays in storage\ndata/*\n!data/schema.json\n*.log\n!keep.log\noutputs/\n/build\n"
    )
    got = sorted(pack_model_dir(model).files)
    assert got == [
        ".detignore",
        "const.yaml",
        "data/schema.json",  # negation brings one file back
        "keep.log",
        "model_def.py",
        "pkg/build/y.txt",  # "/build" is anchored at the top
        "pkg/layers.py",  # "outputs/" is a folder at any depth
    ]
    assert _copied(model, tmp_path) == got


def test_a_negation_cannot_bring_back_a_secret_or_a_database(tmp_path):
    model = _code(tmp_path / "model")
    (model / ".env").write_text("TOKEN=1")
    _sqlite(model / "cache.db")
    (model / ".detignore").write_text("!.env\n!cache.db\n")
    assert pack_model_dir(model).files == [".detignore", *CODE]


def test_a_large_data_file_is_refused_by_name_until_detignore_lists_it(tmp_path):
    """Determined's limit: 95 MiB (MAX_CONTEXT_SIZE, 0.38.1); one line, the largest files
    first, naming .detignore. A sparse file: its size counts, its bytes are never read."""
    assert MAX_MODEL_DEF_BYTES == 95 * 2**20
    model = _code(tmp_path / "model")
    (model / "data").mkdir()
    with open(model / "data" / "images.bin", "wb") as f:
        f.truncate(MAX_MODEL_DEF_BYTES)
    with pytest.raises(PackageError) as refused:
        pack_model_dir(model)
    text = str(refused.value)
    assert "\n" not in text
    assert "over the 95 MB limit" in text
    assert "largest files: data/images.bin (95.0 MB), " in text
    assert f"{model / '.detignore'}" in text
    with pytest.raises(CheckpointError, match=r"largest files: data/images\.bin"):
        _copied(model, tmp_path)
    (model / ".detignore").write_text("data/\n")
    assert pack_model_dir(model).files == [".detignore", *CODE]


def test_a_file_that_vanishes_during_the_copy_is_skipped(tmp_path, monkeypatch):
    """A staging folder removed between the listing and the read (the failure found under
    HOME/.cache/det_tasks/published/<uuid>): left out, the rest copied."""
    model = _code(tmp_path / "model")
    (model / "tmp").mkdir()
    (model / "tmp" / "part.bin").write_bytes(b"p" * 10)

    def listed_then_gone(*args, **kwargs):
        found = real_model_files(*args, **kwargs)
        (model / "tmp" / "part.bin").unlink(missing_ok=True)
        return found

    real_model_files = code_selection.model_files
    monkeypatch.setattr(code_selection, "model_files", listed_then_gone)
    assert _copied(model, tmp_path) == CODE
    (model / "tmp" / "part.bin").write_bytes(b"p" * 10)
    real_sized = code_selection.sized

    def sized_then_gone(files):
        out = real_sized(files)
        (model / "tmp" / "part.bin").unlink(missing_ok=True)
        return out

    monkeypatch.setattr(package_module, "sized", sized_then_gone)
    packed = pack_model_dir(model)
    assert packed.files == CODE
    assert packed.total_bytes == sum((model / f).stat().st_size for f in CODE)


def test_listing_the_model_definition_reads_no_database_twice(tmp_path):
    """model_files is the one rule: packages and code copies agree on it."""
    model = _code(tmp_path / "model")
    _sqlite(model / "x.db")
    assert [rel for rel, _ in model_files(model)] == CODE
