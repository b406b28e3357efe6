"""The experiment config is read and validated once, where it enters, and travels from there
as one object (det_tasks.config.entered): a held trial builds from it with no YAML load and
no validation, the flow's command-line check and the flow share one entry, naming an
experiment validates nothing again, deprecations warn once, and ``fit()`` under an
``exp_conf`` reads it through the loader like every other entry."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from det_tasks.config.entered import EnteredConfig, enter_file, enter_text
from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.experiment_name import named
from det_tasks.errors import ConfigError
from det_tasks.runner.held import HeldTrial, TrialSpec

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn
    from det_tasks.pytorch import DataLoader, PyTorchTrial

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            x = torch.full((2,), float(i))
            return x, x.sum(0, keepdim=True)

    class LineTrial(PyTorchTrial):
        def __init__(self, context):
            self.context = context
            self.model = context.wrap_model(nn.Linear(2, 1))
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3))
        def build_training_data_loader(self):
            return DataLoader(Data(), batch_size=4)
        def build_validation_data_loader(self):
            return DataLoader(Data(), batch_size=4)
        def train_batch(self, batch, epoch_idx, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}
        def evaluate_batch(self, batch):
            x, y = batch
            return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}
    """
)

CONFIG = textwrap.dedent(
    """
    entrypoint: model_def:LineTrial
    batches_per_step: 5
    hyperparameters: {global_batch_size: 4}
    searcher: {name: single, metric: validation_loss, max_length: {batches: 4}}
    """
)

MINIMAL = """
entrypoint: m:T
hyperparameters: {global_batch_size: 2}
searcher: {name: single, metric: m, max_length: {batches: 1}}
"""


class Counts:
    """YAML loads and ExperimentConfig validations in this process while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loads = 0
        self.validations = 0
        load, validate = yaml.load, ExperimentConfig.model_validate.__func__  # type: ignore[attr-defined]

        def counted_load(*args: Any, **kwargs: Any) -> Any:
            self.loads += 1
            return load(*args, **kwargs)

        def counted_validate(cls: type, *args: Any, **kwargs: Any) -> Any:
            self.validations += 1
            return validate(cls, *args, **kwargs)

        monkeypatch.setattr(yaml, "load", counted_load)
        monkeypatch.setattr(ExperimentConfig, "model_validate", classmethod(counted_validate))


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_def.py").write_text(MODEL)
    (model / "config.yaml").write_text(CONFIG)
    return model


def _entered(model_dir: Path, store: Path) -> EnteredConfig:
    overrides = [f"checkpoint_storage={{type: shared_fs, host_path: {store}}}"]
    with pytest.warns(DeprecationWarning, match="batches_per_step is deprecated"):
        return enter_file(model_dir / "config.yaml", overrides)


def test_a_held_trial_builds_from_the_entered_config_without_parsing_or_validating(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = _entered(model_dir, tmp_path / "store")
    (model_dir / "config.yaml").unlink()  # a worker has no copy of the file
    counts = Counts(monkeypatch)
    spec = TrialSpec(str(model_dir / "config.yaml"), str(model_dir), (), 1, {}, config=entered)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the entry warned; nothing again
        held = HeldTrial(spec)
        try:
            assert held.train_to(4) == 4
            _, uri = held.checkpoint()
        finally:
            held.close()
    assert (counts.loads, counts.validations) == (0, 0)
    assert Path(str(uri)).parent == tmp_path / "store"  # the entry's override applied


def test_the_same_file_and_overrides_are_entered_once_per_process(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow's command-line check, then the flow (or ``det-tasks run``'s slot check, then
    its trial): one read, one validation, one warning."""
    counts = Counts(monkeypatch)
    first = _entered(model_dir, tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        again = enter_file(
            model_dir / "config.yaml",
            [f"checkpoint_storage={{type: shared_fs, host_path: {tmp_path / 'store'}}}"],
        )
    assert again is first
    assert counts.validations == 1
    (model_dir / "config.yaml").write_text(CONFIG + "description: changed\n")
    with pytest.warns(DeprecationWarning):  # an edited file is a new entry
        changed = enter_file(model_dir / "config.yaml", [])
    assert changed.config.description == "changed"
    assert counts.validations == 2


def test_naming_an_experiment_validates_nothing_again(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(DeprecationWarning):
        raw, config = enter_file(model_dir / "config.yaml", [])
    counts = Counts(monkeypatch)
    raw, named_config, overrides = named(raw, config, model_dir / "config.yaml", [])
    assert (counts.loads, counts.validations) == (1, 0)  # the name override's value only
    assert named_config.name == "config" and raw["name"] == "config"
    assert overrides == ['name="config"']
    assert named_config.model_dump() == {**config.model_dump(), "name": "config"}


def test_an_unusable_file_name_is_refused_in_the_loader_words(tmp_path: Path) -> None:
    config = tmp_path / "a\tb.yaml"
    config.write_text(MINIMAL)
    raw, cfg = enter_file(config, [])
    with pytest.raises(ConfigError, match=r"`name` = 'a\\tb' is invalid"):
        named(raw, cfg, config, [])


def test_each_reader_gets_its_own_copy_of_the_raw_config() -> None:
    entered = enter_text(
        MINIMAL,
        "c.yaml",
        ["hyperparameters.lr=0.1"],
    )
    raw, _ = entered
    raw["hyperparameters"]["lr"] = 9
    assert entered.raw["hyperparameters"] == {"global_batch_size": 2, "lr": 0.1}


def test_the_file_form_reads_back_without_a_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = enter_text(
        MINIMAL,
        "c.yaml",
        ["name=x"],
    )
    path = entered.write(tmp_path / "config.pickle")
    counts = Counts(monkeypatch)
    again = EnteredConfig.read(path)
    assert (counts.loads, counts.validations) == (0, 0)
    assert again.config == entered.config and again.raw == entered.raw
    (tmp_path / "bad").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match=r"entered config .*bad.* cannot be read"):
        EnteredConfig.read(tmp_path / "bad")


def test_fit_under_an_exp_conf_reads_it_through_the_loader(model_dir: Path) -> None:
    """Deprecations and one-line errors as for a config file (before: pydantic's own text,
    and no deprecation handling)."""
    import sys

    from det_tasks.pytorch import Trainer, init

    sys.path.insert(0, str(model_dir))
    try:
        from model_def import LineTrial  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(model_dir))
    conf = yaml.safe_load(CONFIG)
    deprecated = pytest.warns(DeprecationWarning, match="exp_conf: batches_per_step is deprecated")
    with init(hparams={"global_batch_size": 4}, exp_conf=conf, seed=1) as context, deprecated:
        result = Trainer(LineTrial(context), context).fit()
    assert result.batches_trained == 4
    bad = {k: v for k, v in conf.items() if k != "batches_per_step"}
    bad["searcher"] = {**conf["searcher"], "max_length": {"batches": -1}}
    refused = pytest.raises(ConfigError, match=r"^exp_conf: `searcher.max_length")
    with init(hparams={"global_batch_size": 4}, exp_conf=bad, seed=1) as context, refused:
        Trainer(LineTrial(context), context).fit()
