"""Issue 41 part 6: a checkpoint of a trial written in Determined's pre-0.13 interface
(``build_model()``, ``train_batch(batch, model, ...)``) loads as the bare ``torch.nn.Module``,
as Determined 0.38's ``load_trial_from_checkpoint_path`` returns it, not as our adapter.

The checkpoints are the committed 0.13 fixtures (both key layouts), with their ``code/``
swapped for the same XOR model written in the legacy interface: the weights are known, so
the loaded module must give ``expected_logits.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from det_tasks.compat import load_trial_from_checkpoint_path  # the code imports determined
from det_tasks.errors import CheckpointError

ROOT = Path(__file__).parents[1] / "fixtures" / "determined-legacy"
X = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
EXPECTED = json.loads((ROOT / "expected_logits.json").read_text())

LEGACY_MODEL_DEF = """
import torch
from torch import nn
from determined import pytorch


class XorTrial(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context

    def build_model(self):
        hidden = self.context.get_hparam("hidden_size")
        return nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=self.context.get_hparam("learning_rate"))

    def train_batch(self, batch, model, epoch_idx, batch_idx):
        data, labels = batch
        return {"loss": nn.functional.binary_cross_entropy_with_logits(model(data), labels)}

    def evaluate_batch(self, batch, model):
        data, labels = batch
        loss = nn.functional.binary_cross_entropy_with_logits(model(data), labels)
        return {"validation_loss": loss}

    def build_training_data_loader(self):
        raise NotImplementedError

    def build_validation_data_loader(self):
        raise NotImplementedError
"""


def _with_code(layout: str, tmp_path: Path, model_def: str) -> Path:
    checkpoint = tmp_path / layout
    shutil.copytree(ROOT / layout, checkpoint)
    (checkpoint / "code" / "model_def.py").write_text(model_def)
    return checkpoint


@pytest.mark.parametrize("layout", ["0.13-single-keys", "0.13-legacy-torch-format"])
def test_a_build_model_trial_loads_as_the_bare_module(layout, tmp_path):
    """model_state_dict (0.13's single key) and models_state_dict[0] alike."""
    checkpoint = _with_code(layout, tmp_path, LEGACY_MODEL_DEF)
    loaded = load_trial_from_checkpoint_path(checkpoint, trust_code=True)
    assert type(loaded) is nn.Sequential
    assert loaded(X).detach().squeeze(1).tolist() == EXPECTED
    assert not loaded.training  # ready for inference, as every model this loader returns


def test_weights_are_still_read_safely(tmp_path):
    """The bare-model path reads state_dict.pth like every other: weights_only."""

    class _Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    checkpoint = _with_code("0.13-single-keys", tmp_path, LEGACY_MODEL_DEF)
    torch.save({"model_state_dict": {}, "evil": _Boom()}, checkpoint / "state_dict.pth")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_trial_from_checkpoint_path(checkpoint, trust_code=True)


def test_a_build_model_helper_that_needs_arguments_keeps_the_trial(tmp_path):
    """Determined would call it with none and fail; a current trial with such a helper
    (its models wrapped in __init__) comes back as the trial."""
    model_def = (ROOT / "0.13-single-keys" / "code" / "model_def.py").read_text()
    model_def += (
        "\n\ndef _helper(self, hidden):\n    return nn.Linear(2, hidden)\n\n"
        "XorTrial.build_model = _helper\n"
    )
    checkpoint = _with_code("0.13-single-keys", tmp_path, model_def)
    trial = load_trial_from_checkpoint_path(checkpoint, trust_code=True)
    assert type(trial).__name__ == "XorTrial"
    assert trial.model(X).detach().squeeze(1).tolist() == EXPECTED
