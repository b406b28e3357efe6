"""Checkpoints do not copy themselves (issue 40): with ``host_path`` inside the model
directory under any name, each checkpoint's ``code/`` held every earlier checkpoint
(0.5 MB, 1 MB, 2 MB ... 66 MB, then a size refusal). Packages leave the folder out too."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from det_tasks.checkpoints.format import copy_code
from det_tasks.checkpoints.model_package import pack_model_dir
from det_tasks.config.storage_paths import code_exclusions
from det_tasks.errors import CheckpointError
from det_tasks.runner.cli import main
from det_tasks.runner.trial_setup import load_raw_config

MODEL = Path(__file__).resolve().parent.parent / "fixtures" / "determined_model"


def model_with_storage(tmp_path: Path, host_path: str) -> Path:
    """The XOR trial, 5 batches, a checkpoint after each, all 5 kept, and 64 KB of data
    beside the code so a copied checkpoint would show in the size."""
    model = Path(shutil.copytree(MODEL, tmp_path / "model"))
    (model / "data.bin").write_bytes(bytes(range(256)) * 256)
    text = (model / "const.yaml").read_text()
    text = text.replace("host_path: /tmp", f"host_path: '{host_path}'\n  save_trial_latest: 5")
    text = text.replace("batches: 200", "batches: 5").replace("batches: 100", "batches: 5")
    (model / "const.yaml").write_text(text + "min_checkpoint_period:\n  batches: 1\n")
    return model


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("host_path", ["./ckpt", "./my checkpoints", "./out/ckpt"])
def test_five_checkpoints_inside_the_model_dir_keep_a_constant_code_size(
    tmp_path, monkeypatch, capsys, host_path
):
    model = model_with_storage(tmp_path, host_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(model)  # host_path is relative to the working directory
    assert main(["run", "const.yaml", "--no-progress"]) == 0, capsys.readouterr().err
    checkpoints = [p for p in (model / host_path).iterdir() if p.is_dir()]
    assert len(checkpoints) == 5
    sizes = {tree_bytes(p / "code") for p in checkpoints}
    expected = sum((model / name).stat().st_size for name in ("model_def.py", "const.yaml"))
    assert sizes == {expected + 65536}, sizes
    assert not any((p / "code" / host_path).exists() for p in checkpoints)


def test_package_leaves_the_configured_checkpoint_folder_out(tmp_path, monkeypatch):
    model = model_with_storage(tmp_path, "./my checkpoints")
    old = model / "my checkpoints" / "0b8c" / "state_dict.pth"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x" * 1000)
    (model / "lib" / "ckpt").mkdir(parents=True)  # same-named code elsewhere stays
    (model / "lib" / "ckpt" / "util.py").write_text("X = 1\n")
    monkeypatch.chdir(model)
    raw, _ = load_raw_config(model / "const.yaml", None)
    packed = pack_model_dir(model, excluded_dirs=code_exclusions(raw, model))
    assert "lib/ckpt/util.py" in packed.files
    assert not any(name.startswith("my checkpoints") for name in packed.files)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(packed.data))) as tar:
        assert "my checkpoints/0b8c/state_dict.pth" not in tar.getnames()
    assert "my checkpoints/0b8c/state_dict.pth" in pack_model_dir(model).files  # unasked


def test_copy_code_leaves_out_the_folder_it_is_staged_in(tmp_path):
    model = Path(shutil.copytree(MODEL, tmp_path / "model"))
    store = model / "runs" / "a"
    earlier = store / "1111" / "code"
    earlier.mkdir(parents=True)
    (earlier / "model_def.py").write_text("old copy\n")
    staged = store / "2222"
    staged.mkdir()
    copy_code(model, staged)
    assert sorted(p.name for p in (staged / "code").iterdir()) == ["const.yaml", "model_def.py"]


def test_checkpoints_written_into_the_model_dir_itself_are_refused(tmp_path, capsys, monkeypatch):
    model = model_with_storage(tmp_path, ".")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(model)
    assert main(["run", "const.yaml", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "`checkpoint_storage.host_path` = " in err and "is the model directory itself" in err
    assert sorted(p.name for p in model.iterdir()) == ["const.yaml", "data.bin", "model_def.py"]
    assert main(["check-config", "const.yaml"]) == 1
    assert "is the model directory itself" in capsys.readouterr().err
    staged = model / "0c0c"
    staged.mkdir()
    with pytest.raises(CheckpointError, match=r"into the model directory .* itself"):
        copy_code(model, staged)  # the last line of defence, for any store


def test_a_checkpoint_folder_that_holds_the_model_dir_is_fine(tmp_path, monkeypatch, capsys):
    # Determined's examples use host_path: /tmp: checkpoints land beside the code, not in it.
    model = model_with_storage(tmp_path, str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(model)
    assert main(["run", "const.yaml", "--no-progress"]) == 0, capsys.readouterr().err
    checkpoints = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "model"]
    assert len(checkpoints) == 5
    code = sum((model / n).stat().st_size for n in ("model_def.py", "const.yaml", "data.bin"))
    assert {tree_bytes(p / "code") for p in checkpoints} == {code}


def test_a_store_elsewhere_leaves_out_the_configs_folder_when_told(tmp_path, monkeypatch):
    # The platform stages in its cache; local checkpoints from an earlier run stay out of
    # code/ when the caller passes the config's folders (as write_files should).
    model = model_with_storage(tmp_path, "./ckpt")
    (model / "ckpt" / "0b8c").mkdir(parents=True)
    (model / "ckpt" / "0b8c" / "state_dict.pth").write_bytes(b"x" * 1000)
    monkeypatch.chdir(model)
    raw, _ = load_raw_config(model / "const.yaml", None)
    staged = tmp_path / "cache" / "published" / "1234"
    staged.mkdir(parents=True)
    copy_code(model, staged, code_exclusions(raw, model))
    assert sorted(p.name for p in (staged / "code").iterdir()) == [
        "const.yaml",
        "data.bin",
        "model_def.py",
    ]
