"""The seed documents' other API forms: the legacy trial interface, deprecated calls, the
Trainer-API proposal's calls, and every batch structure the PyTorch guide lists."""

from __future__ import annotations

import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from det_tasks import TrialError, compat, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader, PyTorchCallback
from det_tasks.runner import run_trial
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OnesDataset, OneVarTrial

ROOT = Path(__file__).resolve().parents[2]


def test_legacy_mnist_tutorial_trial_runs_unchanged(tmp_path):
    sys.modules.pop("model_def", None)
    with pytest.warns(DeprecationWarning, match=r"Determined <= 0.12.12.*wrap_model"):
        result = run_trial(
            ROOT / "examples/mnist_legacy/const.yaml", checkpoint_dir=tmp_path, progress=False
        )
    sys.modules.pop("model_def", None)
    # searcher.max_steps: 2 with the default scheduling_unit of 100 batches.
    assert result.batches_trained == 200
    assert result.validation_metrics is not None
    assert result.validation_metrics["validation_error"] < 0.1
    # Same checkpoint format; like Determined, a build_model() trial loads as the bare model.
    loaded = pytorch.load_trial_from_checkpoint_path(result.checkpoint_uri)
    assert type(loaded) is nn.Sequential and not loaded.training
    sys.modules.pop("model_def", None)


class LegacyOneVar(pytorch.PyTorchTrial):
    """The one-variable model in the legacy form: the harness must step the optimizer."""

    def __init__(self, context):
        self.context = context

    def build_model(self):
        model = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def create_lr_scheduler(self, optimizer):
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return pytorch.LRScheduler(sched, pytorch.LRScheduler.StepMode.STEP_EVERY_BATCH)

    def train_batch(self, batch, model, epoch_idx, batch_idx):
        data, labels = batch
        return {"loss": nn.functional.mse_loss(model(data), labels)}

    def evaluate_batch(self, batch, model):
        data, labels = batch
        return {"val_loss": nn.functional.mse_loss(model(data), labels)}

    def build_training_data_loader(self):
        return DataLoader(OnesDataset(), batch_size=4)

    def build_validation_data_loader(self):
        return DataLoader(OnesDataset(8), batch_size=4)


def test_legacy_form_closed_form_weights_with_its_lr_scheduler(tmp_path):
    ctx = pytorch.init(
        hparams={"global_batch_size": 4}, checkpoint_store=LocalDirectoryStore(tmp_path)
    )
    with pytest.warns(DeprecationWarning):
        trainer = pytorch.Trainer(LegacyOneVar(ctx), ctx)
    trainer.fit(max_length=pytorch.Batch(3), checkpoint_policy="none")
    w, lr = 0.0, 0.1
    for _ in range(3):
        w, lr = w + 2 * lr * (1 - w), lr / 2
    assert ctx.models[0].weight.item() == pytest.approx(w, abs=1e-6)


def test_reset_parameters_reinitialises_submodules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    nn.init.zeros_(model[0].weight)
    pytorch.reset_parameters(model)
    assert model[0].weight.abs().sum() > 0


def test_get_optimizer_and_reduce_lr_on_plateau_callback(tmp_path):
    class Plateau(PyTorchCallback):
        def __init__(self, context):
            self.reduce_lr = torch.optim.lr_scheduler.ReduceLROnPlateau(
                context.get_optimizer(), "min", patience=0, factor=0.5
            )

        def on_validation_end(self, metrics):
            self.reduce_lr.step(max(metrics["val_loss"], 10.0))  # flat: never improves

        def state_dict(self):
            return self.reduce_lr.state_dict()

        def load_state_dict(self, state_dict):
            self.reduce_lr.load_state_dict(state_dict)

    class Trial(OneVarTrial):
        def build_callbacks(self):
            with pytest.warns(DeprecationWarning, match="get_optimizer"):
                return {"reduce_lr": Plateau(self.context)}

    ctx = pytorch.init(
        hparams={"learning_rate": 0.4, "global_batch_size": 16},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = Trial(ctx)
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(4), validation_period=pytorch.Batch(1), checkpoint_policy="none"
    )
    # Four validations; the first sets the best, each later one halves the LR.
    assert trial.opt.param_groups[0]["lr"] == pytest.approx(0.4 * 0.5**3)


def test_on_before_optimizer_step_is_called_with_a_deprecation_warning(tmp_path):
    norms = []

    class Clip(PyTorchCallback):
        def on_before_optimizer_step(self, parameters):
            params = list(parameters)
            norms.append(float(params[0].grad.norm()))
            nn.utils.clip_grad_norm_(params, 0.01)

    class Trial(OneVarTrial):
        def build_callbacks(self):
            return {"clip": Clip()}

    ctx = pytorch.init(
        hparams={"learning_rate": 0.5, "global_batch_size": 4},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    trial = Trial(ctx)
    with pytest.warns(DeprecationWarning, match="on_before_optimizer_step is deprecated"):
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(2), checkpoint_policy="none")
    assert norms[0] == pytest.approx(2.0)
    assert trial.weights == pytest.approx([0.005, 0.010], abs=1e-7)


def test_configure_apex_amp_documented_arguments(tmp_path):
    ctx = pytorch.init(hparams={"learning_rate": 0.1, "global_batch_size": 4})
    trial = OneVarTrial(ctx)
    with pytest.warns(UserWarning, match="apex is not available"):
        models, opts = ctx.configure_apex_amp(
            models=[trial.model],
            optimizers=[trial.opt],
            enabled=True,
            opt_level="O2",
            loss_scale="128.0",
            num_losses=1,
            verbosity=0,
            min_loss_scale=1.0,
        )
    assert models == [trial.model] and opts == [trial.opt]
    # On CPU, automatic AMP is fp32 as in Determined: the scaler is a disabled pass-through
    # (the static scale of 128 applies on CUDA).
    assert ctx._scaler is not None and not ctx._scaler.is_enabled()
    disabled = pytorch.init(hparams={"learning_rate": 0.1, "global_batch_size": 4})
    t2 = OneVarTrial(disabled)
    disabled.configure_apex_amp(t2.model, t2.opt, enabled=False)
    assert disabled._scaler is None
    with pytest.raises(ValueError, match="cast_model_type"):
        ctx.configure_apex_amp(trial.model, trial.opt, cast_model_type=torch.float16)


def test_trainer_api_batch_inference_calls(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # no registry: a clear error
    compat.install()
    import determined as det

    ctx = det.pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 8},
        exp_conf={"data": {"batch_size": 4}},
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    assert ctx.training.hparams["global_batch_size"] == 8
    assert ctx.distributed.shard_batch_size(8) == 8
    trial = ctx.build_trial(OneVarTrial)
    metrics = ctx.train(trial, max_length=det.Batches(5), min_checkpoint_period=det.Epochs(1))
    assert metrics is not None and "val_loss" in metrics
    uuid = next(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))

    infer = det.pytorch.init()
    loaded = infer.load_checkpoint_trial(OneVarTrial, path=str(tmp_path / uuid))
    batch_size = ctx.config_data["batch_size"]
    predictions = infer.predict(loaded, det.pytorch.DataLoader(OnesDataset(10), batch_size))
    w = 1 - 0.8**5  # five SGD steps of lr 0.1 from w = 0
    assert predictions.shape == (10, 1)
    assert torch.allclose(predictions, torch.full((10, 1), w), atol=1e-6)
    with pytest.raises(TrialError, match="needs the registry"):
        infer.load_checkpoint_trial(OneVarTrial, trial_id=777)


Pair = namedtuple("Pair", ["data", "label"])
ONES = torch.ones(4, 2)


@pytest.mark.parametrize(
    ("name", "record", "check"),
    [
        ("ndarray", np.ones(2, dtype=np.float32), lambda b: b.shape == (4, 2)),
        ("tensor", torch.ones(2), lambda b: b.shape == (4, 2)),
        (
            "tuple",
            (torch.ones(2), np.zeros(3, dtype=np.float32)),
            lambda b: b[0].shape == (4, 2) and b[1].shape == (4, 3),
        ),
        ("list", [torch.ones(2), torch.zeros(1)], lambda b: b[0].shape == (4, 2)),
        (
            "dict",
            {"data": torch.ones(2), "label": torch.ones(1)},
            lambda b: b["data"].shape == (4, 2) and b["label"].shape == (4, 1),
        ),
        (
            "nested",
            {
                "data": [{"sub_data1": torch.ones(2)}, {"sub_data2": np.zeros(1)}],
                "label": (torch.ones(1), torch.ones(2)),
            },
            lambda b: (
                b["data"][0]["sub_data1"].shape == (4, 2)
                and b["data"][1]["sub_data2"].shape == (4, 1)
                and b["label"][1].shape == (4, 2)
            ),
        ),
        ("namedtuple", Pair(torch.ones(2), torch.ones(1)), lambda b: b.data.shape == (4, 2)),
    ],
)
def test_batch_structures_reach_the_trial_as_tensors_on_the_device(tmp_path, name, record, check):
    seen = {}

    class Records(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return record

    def tensors_only(batch):
        if isinstance(batch, dict):
            return all(tensors_only(v) for v in batch.values())
        if isinstance(batch, list | tuple):
            return all(tensors_only(v) for v in batch)
        return isinstance(batch, torch.Tensor) and batch.device.type == "cpu"

    class Structured(OneVarTrial):
        def build_training_data_loader(self):
            return DataLoader(Records(), batch_size=4, collate_fn=numpy_collate)

        def build_validation_data_loader(self):
            return DataLoader(Records(), batch_size=4, collate_fn=numpy_collate)

        def train_batch(self, batch, epoch_idx, batch_idx):
            seen.setdefault("train", batch)
            loss = self.model(torch.ones(1, 1)).sum() * 0
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}

        def evaluate_batch(self, batch):
            seen.setdefault("eval", batch)
            return {"n": torch.tensor(1.0)}

    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        metrics_sink=InMemoryMetricsSink(),
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    pytorch.Trainer(Structured(ctx), ctx).fit(max_length=pytorch.Batch(1), checkpoint_policy="none")
    for phase in ("train", "eval"):
        assert tensors_only(seen[phase]), (name, phase, seen[phase])
        assert check(seen[phase]), (name, phase)


def numpy_collate(records):
    """Collate that keeps numpy arrays as numpy (like user loaders do): the harness must
    turn them into tensors before train_batch/evaluate_batch."""
    first = records[0]
    if isinstance(first, np.ndarray):
        return np.stack(records)
    if isinstance(first, torch.Tensor):
        return torch.stack(records)
    if isinstance(first, dict):
        return {k: numpy_collate([r[k] for r in records]) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(numpy_collate(list(f)) for f in zip(*records)))
    if isinstance(first, list | tuple):
        return type(first)(numpy_collate(list(f)) for f in zip(*records))
    raise TypeError(type(first))
