"""The harness on a CUDA device (``make test-gpu``; each test skips without CUDA).

Known answers: the one-variable model (w' = w + 2 lr (1 - w) on records (1, 1)) trained by
the harness equals the same model trained by a plain PyTorch loop on the same device, bit
for bit, under fp16 autocast with a GradScaler (whose overflow-skipped steps leave w
unchanged and halve the scale) and under bf16 autocast; the device prefetcher hands
train_batch exactly the batches the CPU sampler makes, and a resumed run equals an
uninterrupted one; a NaN loss is caught on CUDA at the next boundary.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.errors import TrialError
from det_tasks.pytorch import DataLoader
from det_tasks.pytorch._data.feeder import iterate_batches
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LR = 0.1
BATCH = 4
INIT_SCALE = 2.0**18  # the first scaled gradients overflow fp16 (max 65504)


def fit(tmp_path: Path, trial_class: type, batches: int, **kwargs: Any) -> Any:
    ctx = pytorch.init(
        hparams={"learning_rate": LR, "global_batch_size": BATCH},
        metrics_sink=InMemoryMetricsSink(),
        checkpoint_store=LocalDirectoryStore(tmp_path),
        device="cuda",
        exp_conf=kwargs.pop("exp_conf", None),
    )
    trial = trial_class(ctx)
    pytorch.Trainer(trial, ctx).fit(
        max_length=pytorch.Batch(batches), checkpoint_policy="none", **kwargs
    )
    return trial


class Fp16ScalerTrial(OneVarTrial):
    """fp16 autocast and a GradScaler whose first scale overflows the fp16 gradient."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.scaler = context.wrap_scaler(torch.amp.GradScaler("cuda", init_scale=INIT_SCALE))
        self.scales: list[float] = []

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        with torch.autocast("cuda", dtype=torch.float16):
            out = self.model(data)
        assert out.dtype == torch.float16
        loss = nn.functional.mse_loss(out.float(), labels)
        self.context.backward(self.scaler.scale(loss))
        self.context.step_optimizer(self.opt, scaler=self.scaler)
        self.scaler.update()
        self.scales.append(self.scaler.get_scale())
        self.weights.append(float(self.model.weight.detach()))
        return {"loss": loss}


def plain_fp16(batches: int) -> tuple[list[float], list[float]]:
    model = nn.Linear(1, 1, bias=False).cuda()
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cuda", init_scale=INIT_SCALE)
    x = torch.ones(BATCH, 1, device="cuda")
    weights, scales = [], []
    for _ in range(batches):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        weights.append(float(model.weight.detach()))
        scales.append(scaler.get_scale())
    return weights, scales


def test_fp16_autocast_with_grad_scaler(tmp_path: Path) -> None:
    trial = fit(tmp_path, Fp16ScalerTrial, 12)
    weights, scales = plain_fp16(12)
    assert trial.weights == weights and trial.scales == scales  # bit for bit
    # Known answer: a step whose scaled gradient overflowed fp16 is skipped (w unchanged)
    # and halves the scale; every other step follows the closed form (fp16 forward).
    assert scales[0] == INIT_SCALE / 2, "the first scaled gradient should overflow fp16"
    w, previous_weight, previous_scale = 0.0, 0.0, INIT_SCALE
    for got, scale in zip(weights, scales):
        if scale < previous_scale:
            assert scale == previous_scale / 2 and got == previous_weight
        else:
            w = w + 2 * LR * (1.0 - w)
            assert got == pytest.approx(w, abs=2e-3)
        previous_weight, previous_scale = got, scale
    assert w > 0.5  # most steps did happen


class Bf16Trial(OneVarTrial):
    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(data)
        assert out.dtype == torch.bfloat16
        loss = nn.functional.mse_loss(out.float(), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        self.weights.append(float(self.model.weight.detach()))
        return {"loss": loss}


def test_bf16_autocast_equals_a_plain_loop(tmp_path: Path) -> None:
    trial = fit(tmp_path, Bf16Trial, 6)
    model = nn.Linear(1, 1, bias=False).cuda()
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.ones(BATCH, 1, device="cuda")
    expected, w = [], 0.0
    for _ in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.mse_loss(out.float(), x).backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(model.weight.detach()))
        w = w + 2 * LR * (1.0 - w)
        assert expected[-1] == pytest.approx(w, abs=2e-2)  # bf16 forward, fp32 weights
    assert trial.weights == expected


class RecordingTrial(OneVarTrial):
    """A TensorDataset (so the device prefetcher feeds it) of distinct records."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.seen: list[torch.Tensor] = []

    def build_training_data_loader(self) -> DataLoader:
        return DataLoader(_records(), batch_size=BATCH, shuffle=True)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        assert data.is_cuda and labels.is_cuda
        self.seen.append(data.cpu())
        loss = nn.functional.mse_loss(self.model(data), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        self.weights.append(float(self.model.weight.detach()))
        return {"loss": loss}


def _records() -> torch.utils.data.TensorDataset:
    x = torch.arange(40, dtype=torch.float32).reshape(40, 1) / 40
    return torch.utils.data.TensorDataset(x, torch.ones(40, 1))


def test_prefetcher_batches_are_the_samplers_and_resume_is_exact(tmp_path: Path) -> None:
    full = fit(tmp_path / "full", RecordingTrial, 25)  # 10 batches per epoch: 2.5 epochs
    ctx = full.context
    loader = DataLoader(_records(), batch_size=BATCH, shuffle=True)
    host = iterate_batches(loader, seed=ctx.get_trial_seed(), rank=0, size=1, repeat=True)
    for got in full.seen:
        assert torch.equal(got, next(host)[0])

    first = fit(tmp_path / "resumed", RecordingTrial, 13)
    uuid = next((tmp_path / "resumed").glob("*/metadata.json")).parent.name
    ctx2 = pytorch.init(
        hparams={"learning_rate": LR, "global_batch_size": BATCH},
        metrics_sink=InMemoryMetricsSink(),
        checkpoint_store=LocalDirectoryStore(tmp_path / "resumed"),
        device="cuda",
    )
    second = RecordingTrial(ctx2)
    pytorch.Trainer(second, ctx2).fit(
        max_length=pytorch.Batch(25), checkpoint_policy="none", latest_checkpoint=uuid
    )
    assert [torch.equal(a, b) for a, b in zip(first.seen + second.seen, full.seen)] == [True] * 25
    assert first.weights + second.weights == full.weights


class NanAtFour(OneVarTrial):
    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        loss = nn.functional.mse_loss(self.model(data), labels)
        if batch_idx == 4:
            loss = loss * float("nan")
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}


def test_nonfinite_loss_on_cuda(tmp_path: Path) -> None:
    conf = {"optimizations": {"nonfinite_loss": "error"}}
    with pytest.raises(TrialError, match="NaN or infinite at batch 4"):
        fit(tmp_path / "error", NanAtFour, 10, exp_conf=conf, reporting_period=pytorch.Batch(5))
    warn = fit(tmp_path / "warn", NanAtFour, 10, reporting_period=pytorch.Batch(5))
    assert warn.context._nonfinite.nonfinite_batches == 6  # w is NaN from batch 4 on
    skip_conf = {"optimizations": {"nonfinite_loss": "skip"}}
    skipped = fit(tmp_path / "skip", NanAtFour, 10, exp_conf=skip_conf)
    assert skipped.context._nonfinite.skipped_batches == 1
    w = 0.0
    for batch in range(10):
        if batch != 4:
            w = w + 2 * LR * (1.0 - w)
    assert float(skipped.model.weight.detach()) == pytest.approx(w, abs=1e-6)


HOROVOD_SCRIPT = textwrap.dedent(
    """
    import torch, horovod.torch as hvd
    hvd.init()
    assert hvd.nccl_built(), "Horovod was built without NCCL"
    torch.cuda.set_device(hvd.local_rank())
    t = torch.full((4,), 3.0, device="cuda")
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), t)
    model = torch.nn.Linear(1, 1, bias=False).cuda()
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.ones(4, 1, device="cuda")
    torch.nn.functional.mse_loss(model(x), x).backward()
    opt.step()
    assert abs(model.weight.item() - 0.2) < 1e-6, model.weight.item()
    print("horovod nccl ok", hvd.size())
    """
)


def test_one_gpu_horovod_nccl_run(tmp_path: Path) -> None:
    hvd = pytest.importorskip("horovod.torch", reason="Horovod is not installed: make horovod")
    if not hvd.nccl_built():
        pytest.skip("Horovod was built without NCCL: make horovod on a host with nvidia-nccl")
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
    script = tmp_path / "hvd_nccl.py"
    script.write_text(HOROVOD_SCRIPT)
    done = subprocess.run(
        [horovodrun, "-np", "1", "-H", "localhost:1", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "horovod nccl ok 1" in done.stdout
