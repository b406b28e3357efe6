"""Automatic mixed precision on CPU trains in fp32, as Determined does (its AMP is
CUDA-only), with a one-time note: the one-variable weights follow the fp32 closed form."""

from __future__ import annotations

import pytest
import torch

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from tests.fixtures.trials import OneVarTrial

# lr 0.3 makes bf16 rounding visible: 0.3 * (1 - w) in bf16 is off in the third digit.
LR = 0.3


class UseAmpTrial(OneVarTrial):
    def __init__(self, context):
        context.experimental.use_amp()
        super().__init__(context)
        self.dtypes: list[torch.dtype] = []

    def train_batch(self, batch, epoch_idx, batch_idx):
        self.dtypes.append(self.model(batch[0]).dtype)
        return super().train_batch(batch, epoch_idx, batch_idx)


class ApexTrial(UseAmpTrial):
    def __init__(self, context):
        OneVarTrial.__init__(self, context)
        self.dtypes = []
        with pytest.warns(UserWarning, match="apex is not available"):
            self.model, self.opt = context.configure_apex_amp(self.model, self.opt)
        self.extra = context.autocast_forward_pass(torch.nn.Linear(1, 1))


@pytest.mark.parametrize("trial_class", [UseAmpTrial, ApexTrial])
def test_automatic_amp_on_cpu_is_fp32_with_one_note(tmp_path, caplog, trial_class):
    ctx = pytorch.init(
        hparams={"learning_rate": LR, "global_batch_size": 4},
        checkpoint_store=LocalDirectoryStore(tmp_path),
        device="cpu",
    )
    trial = trial_class(ctx)
    pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(6), checkpoint_policy="none")
    w, expected = 0.0, []
    for _ in range(6):
        w = w + 2 * LR * (1.0 - w)
        expected.append(w)
    assert trial.weights == pytest.approx(expected, abs=1e-7)
    assert set(trial.dtypes) == {torch.float32}
    assert ctx._scaler is not None and not ctx._scaler.is_enabled()
    notes = [r for r in caplog.records if "mixed precision is off" in r.getMessage()]
    assert len(notes) == 1
