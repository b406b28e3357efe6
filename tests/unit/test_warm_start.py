"""Issue 15 item 13: searcher.source_checkpoint_uuid / source_trial_id warm-start a trial:
its weights come from that checkpoint, its progress starts at batch 0."""

from __future__ import annotations

import pytest

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.errors import ConfigError
from tests.fixtures.trials import OneVarTrial

HP = {"global_batch_size": 4, "learning_rate": 0.1}


def _fit(tmp_path, batches, searcher_extra=None):
    conf = {"searcher": {"name": "single", "metric": "val_loss", **(searcher_extra or {})}}
    ctx = pytorch.init(hparams=HP, exp_conf=conf, checkpoint_store=LocalDirectoryStore(tmp_path))
    trial = OneVarTrial(ctx)
    result = pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches), checkpoint_policy="none"
    )
    return trial, result


def test_source_checkpoint_uuid_initialises_weights_and_restarts_progress(tmp_path):
    _, source = _fit(tmp_path, 3)
    trial, result = _fit(tmp_path, 2, {"source_checkpoint_uuid": source.checkpoint_uuid})
    # w_k = 1 - 0.8**k: starting from the source's w_3, two more steps give w_4 and w_5.
    assert trial.weights == pytest.approx([1 - 0.8**4, 1 - 0.8**5], rel=1e-6)
    assert result.batches_trained == 2


def test_without_warm_start_the_trial_trains_from_scratch(tmp_path):
    trial, _ = _fit(tmp_path, 2)
    assert trial.weights == pytest.approx([1 - 0.8**1, 1 - 0.8**2], rel=1e-6)


def test_unknown_uuid_without_a_registry_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"searcher\.source_checkpoint_uuid = 'nope'"):
        _fit(tmp_path, 1, {"source_checkpoint_uuid": "nope"})


def test_source_trial_id_without_a_registry_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"searcher\.source_trial_id = 3 needs the MLflow"):
        _fit(tmp_path, 1, {"source_trial_id": 3})
