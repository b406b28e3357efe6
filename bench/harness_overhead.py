"""Harness overhead, measured side by side in one process: compute only vs a plain
PyTorch loop with torch.utils.data.DataLoader vs det_tasks' Trainer.

Same model, data, optimizer and seed for all three; runs are interleaved (A B C A B C ...)
and the median ms/step is reported, so machine noise hits all three alike.

    python bench/harness_overhead.py                       # CPU, tiny MLP, batch 32
    python bench/harness_overhead.py --device cuda --model cnn --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from det_tasks import pytorch
from det_tasks.pytorch import DataLoader, PyTorchCallback, PyTorchTrial
from det_tasks.sinks import InMemoryMetricsSink
from det_tasks.storage import LocalDirectoryStore


def make_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(  # the MNIST tutorial's CNN
        nn.Conv2d(1, 32, 5),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Conv2d(32, 64, 5),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 64, 50),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(50, 10),
    )


def make_data(kind: str, n: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    shape = (n, 32) if kind == "mlp" else (n, 1, 28, 28)
    return torch.utils.data.TensorDataset(
        torch.randn(*shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    )


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "mlp":
        return torch.optim.SGD(model.parameters(), lr=0.01)
    return torch.optim.Adadelta(model.parameters(), lr=1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_only(args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model = make_model(args.model).to(device)
    opt = make_optimizer(args.model, model)
    x, y = make_data(args.model, args.batch_size).tensors
    x, y = x.to(device), y.to(device)
    total = torch.zeros((), device=device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync(device)
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.detach()
    sync(device)
    return (time.perf_counter() - start) / args.steps


def plain_loop(args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model = make_model(args.model).to(device)
    opt = make_optimizer(args.model, model)
    loader = torch.utils.data.DataLoader(
        make_data(args.model, args.records),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=device.type == "cuda",
    )
    total = torch.zeros((), device=device)
    step = 0
    while True:
        for x, y in loader:
            if step == args.warmup:
                sync(device)
                start = time.perf_counter()
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            step += 1
            if step == args.warmup + args.steps:
                sync(device)
                return (time.perf_counter() - start) / args.steps


class BenchTrial(PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        kind = context.get_hparam("model")
        self.model = context.wrap_model(make_model(kind))
        self.opt = context.wrap_optimizer(make_optimizer(kind, self.model))

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": nn.functional.cross_entropy(self.model(x), y)}

    def build_training_data_loader(self) -> DataLoader:
        data = make_data(self.context.get_hparam("model"), self.context.get_hparam("records"))
        return DataLoader(
            data, batch_size=self.context.get_per_slot_batch_size(), shuffle=True, drop_last=True
        )

    def build_validation_data_loader(self) -> DataLoader:
        data = make_data(self.context.get_hparam("model"), self.context.get_per_slot_batch_size())
        return DataLoader(data, batch_size=self.context.get_per_slot_batch_size())


class _Clock(PyTorchCallback):
    """Timestamps the reports after the warm-up batch and after the last batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def on_training_workload_end(self, avg_metrics: Any, batch_metrics: Any) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())


def harness(args: argparse.Namespace, device: torch.device) -> float:
    total = args.warmup + args.steps
    clock = _Clock(device)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = pytorch.init(
            hparams={
                "model": args.model,
                "records": args.records,
                "global_batch_size": args.batch_size,
            },
            metrics_sink=InMemoryMetricsSink(),
            checkpoint_store=LocalDirectoryStore(tmp),
            device=str(device),
            seed=0,
        )
        trial = BenchTrial(ctx)
        trial.build_callbacks = lambda: {"clock": clock}  # type: ignore[method-assign]
        pytorch.Trainer(trial, ctx).fit(
            max_length=pytorch.Batch(total),
            reporting_period=pytorch.Batch([args.warmup, total]),
            checkpoint_policy="none",
        )
    return (clock.stamps[1] - clock.stamps[0]) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--records", type=int, default=0, help="dataset size (default 8 batches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.records = args.records or args.batch_size * 64
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ways: dict[str, Callable[[argparse.Namespace, torch.device], float]] = {
        "compute_only": compute_only,
        "plain_loop": plain_loop,
        "harness": harness,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            times[name].append(fn(args, device))
    ms = {name: 1000 * statistics.median(v) for name, v in times.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"thread(s), torch {torch.__version__}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "ms_per_step": {k: round(v, 4) for k, v in ms.items()},
        "harness_over_plain": round(ms["harness"] / ms["plain_loop"], 3),
        "harness_over_compute": round(ms["harness"] / ms["compute_only"], 3),
        "plain_over_compute": round(ms["plain_loop"] / ms["compute_only"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['device']} | {args.model} batch {args.batch_size} | {result['machine']}")
    for name, value in ms.items():
        print(f"  {name:13s} {value:8.3f} ms/step")
    print(f"  harness / plain loop   = {result['harness_over_plain']:.3f}")
    print(f"  harness / compute only = {result['harness_over_compute']:.3f}")
    print(f"  plain / compute only   = {result['plain_over_compute']:.3f}")


if __name__ == "__main__":
    main()
