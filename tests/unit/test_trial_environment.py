"""What a trial's code finds around it, under ``det-tasks run`` and in a held trial (the
flows' workers), as under Determined: its model directory as the working directory (for
files opened by relative path, at import and in ``__init__``), the experiment config with
defaults filled in, and training metrics reported every ``scheduling_unit`` batches.
Regressions found by the held-out corpus (tests/fixtures/corpus)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from det_tasks.config import load_config
from det_tasks.runner.held import HeldTrial, TrialSpec
from det_tasks.runner.in_process import check_entrypoint, run_trial
from det_tasks.runner.trial_config import with_defaults

MODEL = textwrap.dedent(
    """
    import json
    import os

    import torch
    from torch import nn
    from det_tasks.pytorch import DataLoader, PyTorchTrial

    WORDS = open("words.txt").read().split()  # at import, relative to the working directory

    class Trial(PyTorchTrial):
        def __init__(self, context):
            self.context = context
            with open("sizes.json") as f:  # in __init__, relative again
                self.sizes = json.load(f)
            config = context.get_experiment_config()
            self.seen = {
                "cwd": os.getcwd(),
                "slots": config["resources"]["slots_per_trial"],
                "smaller_is_better": config["searcher"]["smaller_is_better"],
                "metric": config["searcher"]["metric"],
                "hyperparameters": config["hyperparameters"],
            }
            self.model = context.wrap_model(nn.Linear(self.sizes["n"], 1))
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        def build_training_data_loader(self):
            x = torch.ones(12, self.sizes["n"])
            return DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=2)
        def build_validation_data_loader(self):
            x = torch.ones(4, self.sizes["n"])
            return DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=2)
        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss, "in_model_dir": float(os.path.exists("words.txt"))}
        def evaluate_batch(self, batch):
            x, y = batch
            with open(os.path.join(self.context.get_data_config()["out"], "seen.json"), "w") as f:
                json.dump({**self.seen, "words": WORDS}, f)
            return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}
    """
)

CONFIG = textwrap.dedent(
    """
    name: trial-environment
    entrypoint: model_def:Trial
    hyperparameters:
      global_batch_size: 2
      lr: {type: const, val: 0.1}
    searcher: {name: single, metric: validation_loss, max_length: {batches: 6}}
    scheduling_unit: 2
    """
)


# What the trial reads from its config, set explicitly (for tests of other things).
EXPLICIT = ("resources.slots_per_trial=1", "searcher.smaller_is_better=true")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_def.py").write_text(MODEL)
    (folder / "const.yaml").write_text(CONFIG)
    (folder / "words.txt").write_text("alpha beta\n")
    (folder / "sizes.json").write_text('{"n": 3}')
    return folder


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # local sinks and stores
    return cwd


@pytest.fixture
def at_home(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the model directory: the tests below hold without in_model_dir."""
    monkeypatch.chdir(model_dir)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return model_dir


def _seen(out: Path) -> dict:
    return json.loads((out / "seen.json").read_text())


def test_run_trial_runs_the_trial_in_its_model_directory(
    model_dir: Path, elsewhere: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = run_trial(
        model_dir / "const.yaml",
        checkpoint_dir="checkpoints",  # relative: the caller's directory
        overrides=[f"data.out={out}"],
        progress=False,
    )
    assert _seen(out)["cwd"] == str(model_dir) and _seen(out)["words"] == ["alpha", "beta"]
    assert {m["in_model_dir"] for _, m in result.sink.training} == {1.0}
    assert Path.cwd() == elsewhere  # and back
    assert (elsewhere / "checkpoints" / str(result.checkpoint_uuid)).is_dir()
    # A checkpoint named by a path relative to the caller resumes from there.
    resumed = run_trial(
        model_dir / "const.yaml",
        checkpoint_dir="checkpoints",
        overrides=[f"data.out={out}", "searcher.max_length.batches=8"],
        latest_checkpoint=f"checkpoints/{result.checkpoint_uuid}",
        progress=False,
    )
    assert resumed.batches_trained == 8 and resumed.sink.training[0][0] == 8


def test_check_entrypoint_imports_in_the_model_directory(model_dir: Path, elsewhere: Path) -> None:
    trial_class = check_entrypoint(load_config(model_dir / "const.yaml"), model_dir)
    assert trial_class.__name__ == "Trial" and Path.cwd() == elsewhere


def test_a_held_trial_runs_each_step_in_its_model_directory(
    model_dir: Path, elsewhere: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    spec = TrialSpec(
        config_path=str(model_dir / "const.yaml"),
        model_dir=str(model_dir),
        overrides=(f"data.out={out}",),
        trial_id=1,
        hparams={},
    )
    held = HeldTrial(spec)
    try:
        assert Path.cwd() == elsewhere
        held.train_to(3)
        assert Path.cwd() == elsewhere
        held.validate()
    finally:
        held.close()
    assert _seen(out)["cwd"] == str(model_dir) and Path.cwd() == elsewhere


def test_the_experiment_config_has_determineds_defaults_filled_in(
    model_dir: Path, at_home: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_trial(
        model_dir / "const.yaml",
        checkpoint_dir=tmp_path / "ck",
        overrides=[f"data.out={out}"],
        progress=False,
    )
    seen = _seen(out)
    assert (seen["slots"], seen["smaller_is_better"], seen["metric"]) == (
        1,
        True,
        "validation_loss",
    )
    # Hyperparameters as the user wrote them, not the parsed search space.
    assert seen["hyperparameters"] == {"global_batch_size": 2, "lr": {"type": "const", "val": 0.1}}


def test_with_defaults_keeps_what_the_user_wrote() -> None:
    raw = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 2},
        "searcher": {
            "name": "single",
            "metric": "m",
            "smaller_is_better": False,
            "max_length": {"batches": 1},
        },
        "resources": {"slots_per_trial": 1, "max_slots": None},
    }
    from det_tasks.config.loader import parse_config

    filled = with_defaults(raw, parse_config(raw))
    assert filled["searcher"]["smaller_is_better"] is False
    assert filled["resources"] == {
        "slots_per_trial": 1,
        "max_slots": None,
        "distributed_backend": "auto",
    }
    assert filled["scheduling_unit"] == 100 and filled["hyperparameters"] == {
        "global_batch_size": 2
    }
    assert "records_per_epoch" not in filled  # unset and without a default: not invented
    assert raw["resources"] == {"slots_per_trial": 1, "max_slots": None}  # not modified


def test_scheduling_unit_is_the_training_report_period(
    model_dir: Path, at_home: Path, tmp_path: Path
) -> None:
    """Determined's harness reports training metrics every scheduling_unit batches."""
    out = tmp_path / "out"
    out.mkdir()
    result = run_trial(
        model_dir / "const.yaml",
        checkpoint_dir=tmp_path / "ck",
        overrides=[f"data.out={out}", *EXPLICIT],
        progress=False,
    )
    assert [step for step, _ in result.sink.training] == [2, 4, 6]
    spec = TrialSpec(
        config_path=str(model_dir / "const.yaml"),
        model_dir=str(model_dir),
        overrides=(f"data.out={out}", "scheduling_unit=3", *EXPLICIT),
        trial_id=1,
        hparams={},
    )
    held = HeldTrial(spec)
    try:
        held.train_to(6)
        reported = [step for step, _ in held._controller.sink.training]
    finally:
        held.close()
    assert reported == [3, 6]
