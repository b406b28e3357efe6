"""Same seed, same numbers as Determined 0.38.1.

tests/fixtures/determined_rng/expected.json was recorded by real Determined
(tests/fixtures/make_determined_rng_fixture.py) on the trials in model_def.py beside it:
a shuffled loader (one draw from the global torch generator per epoch), dropout, and
validations (each iterator draws a worker base seed). Run unchanged through the
``determined`` alias with the same seed, every training loss and every batch's first
record must match, validation metrics to 1e-6 (Determined averages them in float32).

Where we deliberately differ: a run resumed mid-epoch continues the uninterrupted run's
order and numbers; Determined draws a new order for the resumed epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from det_tasks import compat, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import samplers

HERE = Path(__file__).parents[1] / "fixtures" / "determined_rng"
EXPECTED = json.loads((HERE / "expected.json").read_text())
TRIALS = sorted(EXPECTED["trials"])


@pytest.fixture()
def model_def(monkeypatch):
    compat.install()
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.delitem(sys.modules, "model_def", raising=False)
    import model_def

    yield model_def
    sys.modules.pop("model_def", None)


def train(model_def: Any, name: str, store: Path, length: int, latest: str | None = None):
    ctx = pytorch.init(
        hparams={"global_batch_size": 8},
        seed=EXPECTED["seed"],
        checkpoint_store=LocalDirectoryStore(store),
    )
    trial = getattr(model_def, name)(ctx)
    result = pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(length),
        validation_period=pytorch.Batch(EXPECTED["validation_period"]),
        checkpoint_policy="none",
        latest_checkpoint=latest,
    )
    return trial, result


@pytest.mark.parametrize("name", TRIALS)
def test_same_seed_gives_determineds_numbers(tmp_path, model_def, name):
    want = EXPECTED["trials"][name]
    trial, _ = train(model_def, name, tmp_path, EXPECTED["length"])
    assert trial.first_rows == want["first_rows"]  # the shuffled order, batch by batch
    assert trial.losses == pytest.approx(want["losses"], rel=1e-6, abs=0)
    assert len(trial.recorder.validation) == len(want["validation"])
    for ours, theirs in zip(trial.recorder.validation, want["validation"]):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=0)


def test_resumed_mid_epoch_the_run_continues_the_uninterrupted_one(tmp_path, model_def):
    """5 batches per epoch: stopping at 7 resumes inside the second epoch's order, which
    was drawn before the checkpoint and is replayed from it (Determined would draw anew)."""
    name = "ShuffledDropoutTrial"
    want = EXPECTED["trials"][name]
    _, first = train(model_def, name, tmp_path, 7)
    resumed, _ = train(model_def, name, tmp_path, EXPECTED["length"], first.checkpoint_uuid)
    assert resumed.first_rows == want["first_rows"][7:]
    assert resumed.losses == pytest.approx(want["losses"][7:], rel=1e-6, abs=0)


def test_samplers_give_determineds_streams():
    want = EXPECTED["samplers"]
    shuffle = samplers.ReproducibleShuffleSampler(torch.utils.data.SequentialSampler(range(10)), 5)
    assert [list(shuffle), list(shuffle)] == want["reproducible_shuffle"]
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), 3, False)
    shuffled = samplers.ReproducibleShuffleBatchSampler(batches, 5)
    assert [list(shuffled), list(shuffled)] == want["reproducible_shuffle_batches"]
    stream = samplers.SkipBatchSampler(
        samplers.DistributedBatchSampler(samplers.RepeatBatchSampler(batches), 2, 1), 3
    )
    it = iter(stream)
    assert [next(it) for _ in range(5)] == want["repeat_shard_skip"]
    assert len(samplers.SkipBatchSampler(batches, 2)) == want["skip_len"]
