"""Issue 15 item 10: every checkpoint layout Determined 0.13 to 0.21 wrote loads, safely.

The fixtures (tests/fixtures/make_determined_legacy_checkpoints.py) hold the same trained
XOR weights in eight layouts; each must rebuild the trial with exactly those weights, and
report how far it had trained from whichever progress file its version wrote."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.safe_unpickle import load_pickle
from det_tasks.compat import load_trial_from_checkpoint_path  # their code imports determined
from det_tasks.errors import CheckpointError

ROOT = Path(__file__).parents[1] / "fixtures" / "determined-legacy"
LAYOUTS = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
X = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
EXPECTED = json.loads((ROOT / "expected_logits.json").read_text())
PROGRESS = {
    "0.13-legacy-torch-format": 0,  # nothing recorded how far it trained
    "0.13-single-keys": 0,
}


def test_there_are_eight_layouts():
    assert len(LAYOUTS) == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_with_its_trained_weights(layout):
    trial = load_trial_from_checkpoint_path(ROOT / layout, trust_code=True)
    assert trial.model(X).detach().squeeze(1).tolist() == EXPECTED
    assert trial.context.get_hparam("hidden_size") == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_progress(layout):
    assert ckpt.determined_progress(ROOT / layout) == {"batches_trained": PROGRESS.get(layout, 120)}


def test_numpy1_rng_state_is_read_through_the_allow_list():
    state = ckpt.read_state(ROOT / "0.20-scaler-and-numpy-scalars")
    assert state["callbacks"]["best"]["value"] == 0.125
    assert int(state["callbacks"]["best"]["count"]) == 3
    name, keys, *_ = state["rng_state"]["np_rng_state"]
    assert name == "MT19937" and keys.shape == (624,)


def test_class_comes_from_the_code_config_without_load_data():
    assert not (ROOT / "0.18-no-load-data" / "load_data.json").exists()
    trial = load_trial_from_checkpoint_path(ROOT / "0.18-no-load-data", trust_code=True)
    assert type(trial).__name__ == "XorTrial"
    assert trial.context.get_hparam("learning_rate") == 0.05


class _Boom:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_pickle_naming_other_globals_is_refused(tmp_path):
    bad = tmp_path / "trial_state.pkl"
    bad.write_bytes(pickle.dumps({"batches_trained": _Boom()}))
    with pytest.raises(CheckpointError, match=r"builtins\.print, which is not one of the data"):
        load_pickle(bad)


def test_a_state_dict_naming_other_globals_is_refused(tmp_path):
    shutil_copy(ROOT / "0.21-metadata", tmp_path / "c")
    torch.save({"models_state_dict": [], "evil": _Boom()}, tmp_path / "c" / "state_dict.pth")
    with pytest.raises(CheckpointError, match="weights_only"):
        ckpt.read_state(tmp_path / "c")


def shutil_copy(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_only_false_is_consent_to_run_the_trial_code(layout):
    """Determined's own loading test passes torch_load_kwargs={"weights_only": False}: that
    already lets the checkpoint's pickles run code, so the trial class is rebuilt too, with
    a one-line warning naming what runs."""
    with pytest.warns(UserWarning, match=r"weights_only=False trusts .* importing \S+:XorTrial"):
        trial = load_trial_from_checkpoint_path(
            ROOT / layout, torch_load_kwargs={"weights_only": False}
        )
    assert trial.model(X).detach().squeeze(1).tolist() == EXPECTED


@pytest.mark.parametrize("kwargs", [None, {"weights_only": True}, {"map_location": "cpu"}])
def test_without_that_consent_foreign_code_is_still_refused(kwargs):
    for layout in LAYOUTS:
        with pytest.raises(CheckpointError, match="was not written by this installation"):
            load_trial_from_checkpoint_path(ROOT / layout, torch_load_kwargs=kwargs)


def test_the_harness_loader_finds_the_alias_through_its_entry_point(monkeypatch):
    """det_tasks.pytorch never imports the compatibility layer (it is built from it); its
    loader finds it through the det_tasks.import_layers entry point, so code that imports
    `determined` loads unchanged. Without that entry point the error names the fix."""
    import sys

    from det_tasks import plugins

    def drop_alias() -> None:
        for name in [n for n in sys.modules if n == "determined" or n.startswith("determined.")]:
            monkeypatch.delitem(sys.modules, name)

    drop_alias()
    trial = pytorch.load_trial_from_checkpoint_path(ROOT / "0.21-metadata", trust_code=True)
    assert trial.model(X).detach().squeeze(1).tolist() == EXPECTED
    drop_alias()
    monkeypatch.setattr(plugins, "load_one", lambda group, name: None)
    with pytest.raises(CheckpointError, match=r"imports `determined`.*det_tasks\.compat"):
        pytorch.load_trial_from_checkpoint_path(ROOT / "0.21-metadata", trust_code=True)
    trial = load_trial_from_checkpoint_path(ROOT / "0.21-metadata", trust_code=True)
    assert trial.model(X).detach().squeeze(1).tolist() == EXPECTED
