"""Rebuilding a trial from a checkpoint imports its code/, which runs Python: allowed for
checkpoints this installation signed, for registry references, or with trust_code=True;
refused otherwise, before any of that code runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from det_tasks import CheckpointError, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.checkpoints.trust import TRUSTED_SCHEMES_ENV, trusted_schemes
from det_tasks.sinks import InMemoryMetricsSink

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_DIR = FIXTURES / "determined_model"
DETERMINED_CKPT = FIXTURES / "determined-0.38-checkpoint"


@pytest.fixture(autouse=True)
def _own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DET_TASKS_SIGNING_KEY", raising=False)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from det_tasks import compat

    compat.install()
    sys.path.insert(0, str(MODEL_DIR))
    sys.modules.pop("model_def", None)
    try:
        import model_def

        ctx = pytorch.init(
            hparams={"global_batch_size": 8, "hidden_size": 8, "learning_rate": 0.05},
            exp_conf={"searcher": {"metric": "validation_loss"}},
            metrics_sink=InMemoryMetricsSink(),
            checkpoint_store=LocalDirectoryStore(tmp_path / "store"),
            model_dir=MODEL_DIR,
        )
        result = pytorch.Trainer(model_def.XorTrial(ctx), ctx).fit(max_length=pytorch.Batch(8))
    finally:
        sys.path.remove(str(MODEL_DIR))
        sys.modules.pop("model_def", None)
    return Path(result.checkpoint_uri)


def _rewrite_code(ckpt: Path, source: str) -> None:
    """Replace code/model_def.py and fix its manifest entry (checksums pass, signature not)."""
    target = ckpt / "code" / "model_def.py"
    target.write_text(source)
    meta_path = ckpt / "metadata.json"
    meta = json.loads(meta_path.read_text())
    data = target.read_bytes()
    meta["files"]["code/model_def.py"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    meta_path.write_text(json.dumps(meta))


def test_own_checkpoint_loads_without_asking(checkpoint: Path) -> None:
    trial = pytorch.load_trial_from_checkpoint_path(str(checkpoint))
    assert type(trial).__name__ == "XorTrial"
    assert not list(checkpoint.rglob("__pycache__")), "importing wrote into the checkpoint"


def test_tampered_code_is_refused_before_it_runs(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    original = (checkpoint / "code" / "model_def.py").read_text()
    _rewrite_code(checkpoint, f"open({str(marker)!r}, 'w').close()\n" + original)
    with pytest.raises(CheckpointError, match="trust_code=True") as err:
        pytorch.load_trial_from_checkpoint_path(str(checkpoint))
    assert str(checkpoint) in str(err.value)
    assert not marker.exists()
    sys.modules.pop("model_def", None)
    trial = pytorch.load_trial_from_checkpoint_path(str(checkpoint), trust_code=True)
    sys.modules.pop("model_def", None)
    assert marker.exists() and type(trial).__name__ == "XorTrial"


def test_unlisted_file_in_code_is_refused(checkpoint: Path) -> None:
    (checkpoint / "code" / "sitecustomize.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(CheckpointError, match="not written by this installation"):
        pytorch.load_trial_from_checkpoint_path(str(checkpoint))


def test_another_installations_checkpoint_is_refused(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_TASKS_SIGNING_KEY", "someone-else")
    with pytest.raises(CheckpointError, match="trust_code=True"):
        pytorch.load_trial_from_checkpoint_path(str(checkpoint))


def test_determined_checkpoint_needs_trust_or_a_class(tmp_path: Path) -> None:
    copy = tmp_path / "det"
    shutil.copytree(DETERMINED_CKPT, copy)
    with pytest.raises(CheckpointError, match="trial_class=YourTrial"):
        pytorch.load_trial_from_checkpoint_path(str(copy))
    sys.modules.pop("model_def", None)
    assert pytorch.load_trial_from_checkpoint_path(str(copy), trust_code=True) is not None
    sys.modules.pop("model_def", None)


def test_trusted_schemes_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRUSTED_SCHEMES_ENV, raising=False)
    assert trusted_schemes() == ("runs", "models")
    monkeypatch.setenv(TRUSTED_SCHEMES_ENV, "")
    assert trusted_schemes() == ()
    monkeypatch.setenv(TRUSTED_SCHEMES_ENV, " Models ")
    assert trusted_schemes() == ("models",)
