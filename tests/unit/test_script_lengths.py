"""A Trainer-API script needs no searcher.max_length (its fit(max_length=...) decides, as
Determined accepts such a config); when the searcher does give a length (the config's, an
ASHA rung's `--max-batches`, or test mode) that length governs, not the script's."""

from __future__ import annotations

import textwrap

import pytest

from det_tasks.config import parse_config
from det_tasks.errors import ConfigError
from det_tasks.runner.in_process import run_trial

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn

    import determined as det
    from determined import pytorch


    class Ones(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return torch.ones(1), torch.ones(1)


    class OneVar(pytorch.PyTorchTrial):
        def __init__(self, context):
            self.context = context
            model = nn.Linear(1, 1, bias=False)
            nn.init.zeros_(model.weight)
            self.model = context.wrap_model(model)
            lr = context.get_hparam("learning_rate")
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=lr))

        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}

        def evaluate_batch(self, batch):
            x, y = batch
            return {"val_loss": nn.functional.mse_loss(self.model(x), y)}

        def build_training_data_loader(self):
            return pytorch.DataLoader(Ones(64), batch_size=4)

        def build_validation_data_loader(self):
            return pytorch.DataLoader(Ones(8), batch_size=4)


    if __name__ == "__main__":
        info = det.get_cluster_info()
        with pytorch.init() as context:
            pytorch.Trainer(OneVar(context), context).fit(
                max_length=pytorch.Batch(20),
                latest_checkpoint=info.latest_checkpoint,
                checkpoint_policy="none",
            )
    """
)

CONFIG = """
entrypoint: python3 train.py
hyperparameters:
  global_batch_size: 4
  learning_rate: 0.1
searcher:
  name: single
  metric: val_loss
"""


@pytest.fixture()
def model_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "const.yaml").write_text(CONFIG)
    return tmp_path


def run(model_dir, tmp_path, **kwargs):
    return run_trial(
        model_dir / "const.yaml", checkpoint_dir=tmp_path / "ckpt", progress=False, **kwargs
    )


def val_loss_after(batches: int) -> float:
    # w' = w + 2 lr (1 - w) from w = 0 on (1, 1): 1 - w_n = 0.8^n, val_loss = (1 - w_n)^2.
    return 0.8 ** (2 * batches)


def test_without_a_searcher_length_the_script_decides(model_dir, tmp_path):
    result = run(model_dir, tmp_path)
    assert result.batches_trained == 20
    assert result.validation_metrics["val_loss"] == pytest.approx(val_loss_after(20), rel=1e-5)


def test_the_searchers_length_overrides_the_scripts(model_dir, tmp_path):
    with pytest.warns(UserWarning, match=r"fit\(max_length=Batch\(20\)\) is overridden"):
        result = run(model_dir, tmp_path, max_batches=7)  # an ASHA rung, a flow's segment
    assert result.batches_trained == 7
    assert result.validation_metrics["val_loss"] == pytest.approx(val_loss_after(7), rel=1e-5)


def test_config_length_and_test_mode_govern_too(model_dir, tmp_path):
    with pytest.warns(UserWarning, match=r"overridden by the searcher's length Batch\(5\)"):
        result = run(model_dir, tmp_path, overrides=["searcher.max_length.batches=5"])
    assert result.batches_trained == 5
    result = run(model_dir, tmp_path / "t", test_mode=True)
    assert result.batches_trained == 1


def test_a_trial_class_still_needs_a_length():
    raw = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 4},
        "searcher": {"name": "single", "metric": "loss"},
    }
    with pytest.raises(ConfigError, match=r"searcher\.max_length is missing"):
        parse_config(raw, source="const.yaml")
    raw["entrypoint"] = "python3 train.py"
    assert not parse_config(raw, source="const.yaml").has_max_length
