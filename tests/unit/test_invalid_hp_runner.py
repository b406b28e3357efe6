"""Issue 15 item 13: a trial raising det.InvalidHP ends `det-tasks run` with
EXIT_INVALID_HP and a summary the searcher reads (`invalid_hp`), not a failure to retry."""

from __future__ import annotations

import json
import textwrap

from det_tasks.errors import EXIT_INVALID_HP
from det_tasks.runner.cli import main

TRIAL = """
import determined as det
from determined import pytorch


class Trial(pytorch.PyTorchTrial):
    def __init__(self, context):
        if context.get_hparam("width") < 1:
            raise det.InvalidHP(f"width must be >= 1, got {context.get_hparam('width')}")

    def train_batch(self, batch, epoch_idx, batch_idx):
        raise AssertionError("never reached")

    def evaluate_batch(self, batch):
        raise AssertionError("never reached")

    def build_training_data_loader(self):
        raise AssertionError("never reached")

    def build_validation_data_loader(self):
        raise AssertionError("never reached")
"""

CONFIG = """
entrypoint: model_def:Trial
hyperparameters: {global_batch_size: 2, width: -1}
searcher: {name: single, metric: loss, max_length: {batches: 2}}
"""


def test_invalid_hp_exits_with_its_own_code_and_summary(tmp_path, monkeypatch, capsys):
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_def.py").write_text(textwrap.dedent(TRIAL))
    (model / "const.yaml").write_text(CONFIG)
    summary = tmp_path / "summary.json"
    code = main(
        [
            "run", str(model / "const.yaml"), str(model), "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--hparams", json.dumps({"global_batch_size": 2, "width": -1}),
            "--summary-file", str(summary),
        ]
    )  # fmt: skip
    assert code == EXIT_INVALID_HP == 3
    assert json.loads(summary.read_text()) == {
        "invalid_hp": "width must be >= 1, got -1",
        "hparams": {"global_batch_size": 2, "width": -1},
    }
    err = capsys.readouterr().err
    assert "invalid hyperparameters: width must be >= 1, got -1" in err
    assert "Traceback" not in err
