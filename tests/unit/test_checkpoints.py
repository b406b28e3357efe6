"""Checkpoint layout, load_trial_from_checkpoint_path on ours and on Determined's, and
refusal of missing, truncated or corrupted checkpoints."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from det_tasks import CheckpointError, compat, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_DIR = FIXTURES / "determined_model"
DETERMINED_CKPT = FIXTURES / "determined-0.38-checkpoint"
XOR = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])


@pytest.fixture
def xor_module():
    compat.install()
    sys.path.insert(0, str(MODEL_DIR))
    try:
        sys.modules.pop("model_def", None)
        yield importlib.import_module("model_def")
    finally:
        sys.path.remove(str(MODEL_DIR))
        sys.modules.pop("model_def", None)


@pytest.fixture
def trained(tmp_path, xor_module):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"global_batch_size": 8, "hidden_size": 8, "learning_rate": 0.05},
        exp_conf={"searcher": {"metric": "validation_loss"}},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path / "store"),
        model_dir=MODEL_DIR,
    )
    trial = xor_module.XorTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(60))
    return trial, result, sink


def test_layout_matches_determined(trained):
    _, result, _ = trained
    path = Path(result.checkpoint_uri)
    assert sorted(p.name for p in path.iterdir()) == [
        "code",
        "load_data.json",
        "metadata.json",
        "state_dict.pth",
    ]
    state = torch.load(path / "state_dict.pth", weights_only=True)
    assert {
        "models_state_dict",
        "optimizers_state_dict",
        "lr_schedulers_state_dict",
        "callbacks",
        "rng_state",
        "trial_state",
    } <= set(state)
    load_data = json.loads((path / "load_data.json").read_text())
    assert load_data["trial_cls_spec"] == "model_def:XorTrial"
    assert load_data["hparams"]["hidden_size"] == 8
    metadata = json.loads((path / "metadata.json").read_text())
    assert metadata["format_version"] == 1 and metadata["steps_completed"] == 60
    assert set(metadata["files"]) == {
        "state_dict.pth",
        "load_data.json",
        "code/model_def.py",
        "code/const.yaml",
    }
    assert (path / "code" / "model_def.py").read_text() == (MODEL_DIR / "model_def.py").read_text()


def test_load_our_checkpoint_without_trial_class(trained):
    trial, result, _ = trained
    sys.modules.pop("model_def", None)  # must come from the checkpoint's code/
    loaded = pytorch.load_trial_from_checkpoint_path(result.checkpoint_uri)
    assert type(loaded).__name__ == "XorTrial"
    for a, b in zip(trial.model.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)
    assert not loaded.model.training
    assert loaded.context.get_hparam("hidden_size") == 8


def test_load_with_hparams_override_and_trial_class(trained, xor_module):
    _, result, _ = trained
    loaded = pytorch.load_trial_from_checkpoint_path(
        result.checkpoint_uri,
        trial_class=xor_module.XorTrial,
        hparams={"global_batch_size": 8, "hidden_size": 8, "learning_rate": 0.5},
    )
    assert loaded.context.get_hparam("learning_rate") == 0.5


def test_load_checkpoint_written_by_determined():
    sys.modules.pop("model_def", None)
    trial = pytorch.load_trial_from_checkpoint_path(str(DETERMINED_CKPT), trust_code=True)
    with torch.no_grad():
        predictions = (trial.model(XOR) > 0).float().squeeze(1)
    assert predictions.tolist() == [0.0, 1.0, 1.0, 0.0]
    saved = torch.load(DETERMINED_CKPT / "state_dict.pth", weights_only=False)
    for a, b in zip(saved["models_state_dict"][0].values(), trial.model.state_dict().values()):
        assert torch.equal(a, b)
    sys.modules.pop("model_def", None)


def test_resume_from_determined_checkpoint_continues_at_its_step(tmp_path, xor_module):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"global_batch_size": 4, "hidden_size": 8, "learning_rate": 0.05},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    result = pytorch.Trainer(xor_module.XorTrial(ctx), ctx).fit(
        max_length=pytorch.Batch(410),
        latest_checkpoint=str(DETERMINED_CKPT),
        reporting_period=pytorch.Batch(5),
        checkpoint_policy="none",
    )
    assert result.batches_trained == 410
    assert [s for s, _ in sink.training] == [405, 410]
    assert sink.validation[-1][1]["accuracy"] == 1.0


def _corrupt_copy(src: Path, dst: Path, mutate) -> Path:
    shutil.copytree(src, dst)
    mutate(dst / "state_dict.pth")
    return dst


def test_flipped_bytes_are_refused_with_the_file_and_checksum(trained, tmp_path):
    _, result, _ = trained

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    bad = _corrupt_copy(Path(result.checkpoint_uri), tmp_path / "flipped", flip)
    with pytest.raises(CheckpointError, match=r"state_dict.pth.*corrupted: sha256"):
        pytorch.load_trial_from_checkpoint_path(str(bad))


def test_truncated_file_is_refused(trained, tmp_path):
    _, result, _ = trained

    def cut(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:100])

    bad = _corrupt_copy(Path(result.checkpoint_uri), tmp_path / "cut", cut)
    with pytest.raises(CheckpointError, match=r"state_dict.pth.*truncated"):
        pytorch.load_trial_from_checkpoint_path(str(bad))


def test_truncated_determined_checkpoint_names_the_file(tmp_path):
    bad = _corrupt_copy(
        DETERMINED_CKPT, tmp_path / "det", lambda p: p.write_bytes(p.read_bytes()[:500])
    )
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint file .*state_dict.pth"):
        pytorch.load_trial_from_checkpoint_path(str(bad))


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        pytorch.load_trial_from_checkpoint_path(str(tmp_path / "nope"))


def test_unknown_uri_scheme_is_refused():
    with pytest.raises(CheckpointError, match="'gopher' scheme"):
        pytorch.load_trial_from_checkpoint_path("gopher://host/ckpt")


def test_pickled_objects_are_refused_by_default(tmp_path, trained):
    _, result, _ = trained
    bad = Path(shutil.copytree(result.checkpoint_uri, tmp_path / "evil"))
    (bad / "metadata.json").unlink()  # no manifest: straight to the safe loader
    torch.save({"models_state_dict": [], "payload": Path("/etc/passwd")}, bad / "state_dict.pth")
    with pytest.raises(CheckpointError, match="weights_only"):
        pytorch.load_trial_from_checkpoint_path(str(bad))


def test_loading_uses_the_checkpoints_own_code_not_a_same_named_module(tmp_path):
    """Every model directory calls its module `model_def`: a checkpoint must load with the
    code it recorded even when another `model_def` is already imported in this process."""
    import sys
    from pathlib import Path

    from det_tasks.runner import run_trial

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    result = run_trial(
        fixtures / "flow_model" / "grid.yaml",
        checkpoint_dir=tmp_path,
        progress=False,
        hparams={"global_batch_size": 8, "learning_rate": 0.1, "hidden": 4},
        max_batches=2,
    )
    other = type(sys)("model_def")
    other.__file__ = str(fixtures / "determined_model" / "model_def.py")
    sys.modules["model_def"] = other  # what another model directory left behind
    try:
        trial = pytorch.load_trial_from_checkpoint_path(result.checkpoint_uri)
        assert type(trial).__name__ == "XorTrial"
        assert sys.modules["model_def"] is other  # the process's own module is put back
    finally:
        sys.modules.pop("model_def", None)
