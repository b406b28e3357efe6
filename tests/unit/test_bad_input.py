"""User mistakes give one paragraph naming what and where, never a deep traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from det_tasks import CheckpointError, ConfigError, TrialError, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.config import load_config
from det_tasks.runner.cli import main
from tests.fixtures.trials import OneVarTrial

GOOD = """
entrypoint: model_def:MNistTrial
hyperparameters:
  global_batch_size: 32
  learning_rate: 0.1
searcher:
  name: single
  metric: validation_error
  max_length:
    batches: 10
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def cli_error(tmp_path, capsys, text: str) -> str:
    code = main(["run", str(write(tmp_path, text)), str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_good_config_loads(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    assert config.max_length.batches == 10


def test_malformed_yaml_names_the_line(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, "searcher:\n  name: [single\n  metric: x\n")
    assert "config.yaml" in err and "not valid YAML at line 3" in err


def test_unknown_field_names_it_and_suggests_the_fix(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, GOOD.replace("max_length:", "max_lenght:"))
    assert "unknown field `searcher.max_lenght`; did you mean `max_length`?" in err


def test_wrong_type_names_the_field_and_value(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, GOOD.replace("batches: 10", "batches: ten"))
    assert "`searcher.max_length.batches` = 'ten' is invalid" in err


def test_missing_global_batch_size(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, GOOD.replace("  global_batch_size: 32\n", ""))
    assert "hyperparameters.global_batch_size is missing" in err


def test_typo_in_checkpoint_policy_is_not_silently_accepted(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, GOOD + "checkpoint_policy: bset\n")
    assert "`checkpoint_policy` = 'bset' is invalid" in err and "did you mean 'best'" in err


def test_missing_config_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml"), "--no-progress"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_entrypoint_module_missing(tmp_path, capsys):
    err = cli_error(tmp_path, capsys, GOOD)
    assert "no module 'model_def' in model directory" in err


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 12)]
    with pytest.raises(ConfigError, match="aliases"):
        load_config(write(tmp_path, "\n".join(lines)))


def test_deprecated_field_warns_and_translates(tmp_path):
    text = GOOD.replace("max_length:\n    batches: 10", "max_steps: 3")
    with pytest.warns(DeprecationWarning, match="max_steps is deprecated"):
        config = load_config(write(tmp_path, text + "scheduling_unit: 5\n"))
    assert config.max_length.batches == 15


def test_train_unit_below_one_is_an_error():
    with pytest.raises(ValueError, match=r"Batch\(0\) is not a valid length"):
        pytorch.Batch(0)
    with pytest.raises(ValueError, match="every point must be an int >= 1"):
        pytorch.Epoch([2, 0])


def fit(tmp_path, trial_cls):
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    return pytorch.Trainer(trial_cls(ctx), ctx).fit(max_length=pytorch.Batch(2))


def test_trial_without_wrapped_model(tmp_path):
    class NoModel(OneVarTrial):
        def __init__(self, context):
            self.context = context

    with pytest.raises(TrialError, match=r"wrapped no model.*context.wrap_model"):
        fit(tmp_path, NoModel)


@pytest.mark.parametrize("returned", [[1.0], "loss", 3.0])
def test_train_batch_returning_a_non_dict(tmp_path, returned):
    class BadReturn(OneVarTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            super().train_batch(batch, epoch_idx, batch_idx)
            return returned

    with pytest.raises(TrialError, match=r"train_batch\(\) must return a dict"):
        fit(tmp_path, BadReturn)


def test_bad_checkpoint_policy_argument(tmp_path):
    ctx = pytorch.init(hparams={"learning_rate": 0.1, "global_batch_size": 4})
    with pytest.raises(ValueError, match="did you mean 'best'"):
        pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
            max_length=pytorch.Batch(1), checkpoint_policy="bset"
        )


def test_missing_max_length_in_local_training(tmp_path):
    ctx = pytorch.init(hparams={"learning_rate": 0.1, "global_batch_size": 4})
    with pytest.raises(ValueError, match="needs max_length"):
        pytorch.Trainer(OneVarTrial(ctx), ctx).fit()


def test_resume_from_missing_checkpoint(tmp_path):
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    with pytest.raises(CheckpointError, match="'0000-missing' does not exist"):
        pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
            max_length=pytorch.Batch(1), latest_checkpoint="0000-missing"
        )


def test_unknown_hparam_names_the_defined_ones():
    ctx = pytorch.init(hparams={"learning_rate": 0.1, "global_batch_size": 4})
    with pytest.raises(ValueError, match=r"'lr' is not defined.*global_batch_size, learning_rate"):
        ctx.get_hparam("lr")


def test_wrap_model_type_error():
    ctx = pytorch.init(hparams={})
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ctx.wrap_model(torch.zeros(3))  # type: ignore[arg-type]


def test_a_misspelt_override_is_blamed_on_the_command_line_not_the_file(tmp_path, capsys):
    config = write(tmp_path, GOOD)
    code = main(["run", str(config), "-p", "searcher.max_lenght.batches=3", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (
        "error: command-line override 'searcher.max_lenght.batches=3': unknown field "
        "`searcher.max_lenght`; did you mean `max_length`?\n"
    )


def test_a_file_error_is_still_the_files_when_overrides_are_given(tmp_path, capsys):
    config = write(tmp_path, GOOD.replace("batches: 10", "batches: ten"))
    code = main(["run", str(config), "-p", "hyperparameters.global_batch_size=8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {config}: `searcher.max_length.batches` = 'ten' is invalid")
