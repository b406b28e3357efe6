"""One rule turns a config length into what the loop counts (det_tasks.config.lengths), and
every caller uses it: the runners (``det-tasks run``, a held trial) and ``Trainer.fit``
under an experiment config. Known answers, with and without ``records_per_epoch``."""

from __future__ import annotations

import pytest

from det_tasks import ConfigError, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.config import Length, parse_config
from det_tasks.config.lengths import in_batches_or_epochs
from det_tasks.pytorch._trainer import length_to_unit
from det_tasks.runner.trial_setup import train_unit
from tests.fixtures.trials import OneVarTrial


@pytest.mark.parametrize(
    ("length", "gbs", "records_per_epoch", "expected"),
    [
        ({"batches": 7}, 32, None, {"batches": 7}),
        ({"batches": 7}, 32, 1000, {"batches": 7}),
        ({"epochs": 2}, 32, None, {"epochs": 2}),
        ({"epochs": 2}, None, 1000, {"epochs": 2}),  # no batch size: epochs of the loader
        ({"epochs": 2}, 32, 1000, {"batches": 62}),  # 2 * 1000 // 32
        ({"epochs": 1}, 64, 10, {"batches": 1}),  # never zero batches
        ({"records": 1000}, 32, None, {"batches": 31}),  # 1000 // 32
        ({"records": 1000}, 32, 500, {"batches": 31}),  # records ignore records_per_epoch
        ({"records": 10}, 32, None, {"batches": 1}),
    ],
)
def test_known_answers(length, gbs, records_per_epoch, expected):
    assert in_batches_or_epochs(Length(**length), gbs, records_per_epoch) == Length(**expected)


def test_records_without_a_batch_size_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"records: 1000.*hyperparameters\.global_batch_size"):
        in_batches_or_epochs(Length(records=1000), None)


def test_the_loop_gets_batch_or_epoch_units():
    assert length_to_unit(Length(epochs=3), 32) == pytorch.Epoch(3)
    assert length_to_unit(Length(epochs=3), 32, 320) == pytorch.Batch(30)
    assert length_to_unit(Length(records=96), 32) == pytorch.Batch(3)


def _config(**extra):
    return parse_config(
        {
            "entrypoint": "model_def:Trial",
            "hyperparameters": {"global_batch_size": 32},
            "searcher": {"name": "single", "metric": "loss", "max_length": {"epochs": 2}},
            **extra,
        }
    )


def test_the_runners_use_records_per_epoch():
    config = _config(records_per_epoch=1000, min_validation_period={"epochs": 1})
    assert train_unit(config, config.max_length, 32) == pytorch.Batch(62)
    assert train_unit(config, config.min_validation_period, 32) == pytorch.Batch(31)
    assert train_unit(config, None, 32) is None
    plain = _config()
    assert train_unit(plain, plain.max_length, 32) == pytorch.Epoch(2)


def test_fit_under_an_experiment_config_uses_records_per_epoch(tmp_path):
    """The loader's epoch is 8 batches (64 records / 8); the config's is 40 // 8 = 5."""
    context = pytorch.init(
        hparams={"global_batch_size": 8, "learning_rate": 0.1},
        exp_conf={
            "entrypoint": "model_def:Trial",
            "hyperparameters": {"global_batch_size": 8, "learning_rate": 0.1},
            "records_per_epoch": 40,
            "searcher": {"name": "single", "metric": "val_loss", "max_length": {"epochs": 1}},
        },
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    with context:
        result = pytorch.Trainer(OneVarTrial(context), context).fit()
    assert result.batches_trained == 5
