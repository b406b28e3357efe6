"""Gradient aggregation, gradient clipping and automatic mixed precision, with known answers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from det_tasks import ConfigError, TrialError, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader, PyTorchTrial
from tests.fixtures.trials import OneVarTrial

X = torch.linspace(-1, 1, 32).unsqueeze(1)
Y = 3 * X + 0.5


class RegressionTrial(PyTorchTrial):
    def __init__(self, context):
        self.context = context
        model = nn.Linear(1, 1)
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.3))
        self.history = []

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        self.history.append(self.model.weight.item())
        return loss

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self):
        return DataLoader(
            torch.utils.data.TensorDataset(X, Y), batch_size=self.context.get_per_slot_batch_size()
        )

    def build_validation_data_loader(self):
        return DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)


def train(tmp_path, trial_cls=RegressionTrial, batches=4, **init_kwargs):
    init_kwargs.setdefault("hparams", {"global_batch_size": 4})
    ctx = pytorch.init(checkpoint_store=LocalDirectoryStore(tmp_path), **init_kwargs)
    trial = trial_cls(ctx)
    pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(batches), checkpoint_policy="none")
    return trial


def test_aggregating_two_batches_equals_one_step_on_both(tmp_path):
    aggregated = train(tmp_path / "a", batches=8, aggregation_frequency=2)
    combined = train(tmp_path / "b", batches=4, hparams={"global_batch_size": 8})
    # No step on the first batch of each pair, then the same weights as the big batch.
    assert aggregated.history[0] == 0.0
    assert aggregated.history[1::2] == pytest.approx(combined.history, abs=1e-6)
    for a, b in zip(aggregated.model.parameters(), combined.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_aggregation_frequency_from_experiment_config(tmp_path):
    conf = {"optimizations": {"aggregation_frequency": 2}}
    trial = train(tmp_path, batches=4, exp_conf=conf)
    assert trial.history[0] == 0.0 and trial.history[1] != 0.0


def test_conflicting_aggregation_frequency_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="aggregation_frequency"):
        pytorch.init(
            aggregation_frequency=4, exp_conf={"optimizations": {"aggregation_frequency": 2}}
        )


def test_clip_grads_bounds_the_update(tmp_path):
    class Clipped(OneVarTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            data, labels = batch
            loss = nn.functional.mse_loss(self.model(data), labels)
            self.context.backward(loss)
            self.context.step_optimizer(
                self.opt, clip_grads=lambda params: nn.utils.clip_grad_norm_(params, 0.01)
            )
            self.weights.append(self.model.weight.item())
            return loss

    trial = train(
        tmp_path, Clipped, batches=3, hparams={"global_batch_size": 4, "learning_rate": 0.5}
    )
    # Unclipped gradient is -2(1-w) (norm ~2): clipped to 0.01, each step moves w by lr*0.01.
    assert trial.weights == pytest.approx([0.005, 0.010, 0.015], abs=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_use_amp_fp16_with_grad_scaler_on_cuda(tmp_path):
    """On CUDA, use_amp() autocasts to fp16 and scales the loss (on CPU it is fp32:
    test_amp_cpu.py)."""
    seen_dtypes = []

    class Amp(OneVarTrial):
        def __init__(self, context):
            context.experimental.use_amp()
            super().__init__(context)

        def train_batch(self, batch, epoch_idx, batch_idx):
            data, labels = batch
            out = self.model(data)
            seen_dtypes.append(out.dtype)
            loss = nn.functional.mse_loss(out.float(), labels)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            self.weights.append(self.model.weight.item())
            return loss

    trial = train(tmp_path, Amp, batches=3, hparams={"global_batch_size": 4, "learning_rate": 0.1})
    assert seen_dtypes == [torch.float16] * 3
    scaler = trial.context._scaler
    assert scaler is not None and scaler.get_scale() == 65536.0
    # The loss was scaled by 65536 and unscaled before the step: w follows the closed form
    # (0.2, 0.36, 0.488) within fp16 precision, not 65536 times too far.
    assert trial.weights == pytest.approx([0.2, 0.36, 0.488], abs=2e-3)
    saved = next(p for p in (tmp_path).iterdir() if not p.name.startswith("."))
    state = torch.load(saved / "state_dict.pth", weights_only=False)
    assert "scaler_state_dict" in state


def test_configure_apex_amp_o1_maps_to_native_amp_and_o3_is_refused(tmp_path):
    class Apex(OneVarTrial):
        def __init__(self, context):
            super().__init__(context)
            self.model, self.opt = context.configure_apex_amp(self.model, self.opt, opt_level="O1")

    with pytest.warns(UserWarning, match="native torch.autocast"):
        trial = train(
            tmp_path, Apex, batches=2, hparams={"global_batch_size": 4, "learning_rate": 0.1}
        )
    assert trial.context._scaler is not None
    assert trial.weights == pytest.approx([0.2, 0.36], abs=2e-2)

    class ApexO3(OneVarTrial):
        def __init__(self, context):
            super().__init__(context)
            context.configure_apex_amp(self.model, self.opt, opt_level="O3")

    with pytest.raises(ValueError, match="wrap_scaler"):
        train(tmp_path, ApexO3, hparams={"global_batch_size": 4, "learning_rate": 0.1})


def test_lr_scheduler_step_modes(tmp_path):
    lrs = {}

    def make(mode, name):
        class Scheduled(RegressionTrial):
            def __init__(self, context):
                super().__init__(context)
                sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: 0.5**step)
                context.wrap_lr_scheduler(sched, mode)
                self.sched = sched

            def train_batch(self, batch, epoch_idx, batch_idx):
                lrs.setdefault(name, []).append(self.opt.param_groups[0]["lr"])
                if mode is pytorch.LRScheduler.StepMode.MANUAL_STEP and batch_idx == 5:
                    self.sched.step()
                return super().train_batch(batch, epoch_idx, batch_idx)

        return Scheduled

    mode = pytorch.LRScheduler.StepMode
    # 32 records / 8 = 4 batches per epoch; aggregation 2 -> an optimizer step every 2 batches.
    for m in mode:
        train(
            tmp_path / m.name,
            make(m, m.name),
            batches=8,
            hparams={"global_batch_size": 8},
            aggregation_frequency=2,
        )
    a = 0.3
    assert lrs["STEP_EVERY_BATCH"] == [a, a, a / 4, a / 4, a / 16, a / 16, a / 64, a / 64]
    assert lrs["STEP_EVERY_OPTIMIZER_STEP"] == [a, a, a / 2, a / 2, a / 4, a / 4, a / 8, a / 8]
    assert lrs["STEP_EVERY_EPOCH"] == [a] * 4 + [a / 2] * 4
    assert lrs["MANUAL_STEP"] == [a] * 6 + [a / 2] * 2


def test_step_optimizer_rejects_unwrapped_optimizer(tmp_path):
    class Unwrapped(OneVarTrial):
        def train_batch(self, batch, epoch_idx, batch_idx):
            other = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.context.step_optimizer(other)
            return {}

    with pytest.raises(TrialError, match="wrap_optimizer"):
        train(tmp_path, Unwrapped, hparams={"global_batch_size": 4, "learning_rate": 0.1})
