"""Harness overhead, measured side by side in one process: compute only vs a plain
PyTorch loop with torch.utils.data.DataLoader vs det_tasks' Trainer.

Same model, data, optimizer and seed for all three; runs are interleaved (A B C A B C ...)
and the median ms/step is reported, so machine noise hits all three alike.

    python bench/harness_overhead.py                       # CPU, tiny MLP, batch 32
    python bench/harness_overhead.py --data map --steps 8000  # per-sample __getitem__
    python bench/harness_overhead.py --device cuda --model cnn --batch-size 64

A count that no other job on the machine can move: instructions per step under valgrind
(``--only`` runs one way; the difference of two step counts cancels the start-up), e.g.

    OPENBLAS_NUM_THREADS=1 valgrind --tool=cachegrind --cache-sim=no \
        --cachegrind-out-file=/dev/null python bench/harness_overhead.py --data map \
        --only harness --repeats 1 --warmup 20 --steps 250     # and --steps 50

(OpenBLAS's idle threads spin under valgrind and would add a random count otherwise.)

``--data map`` wraps the same tensors in a map-style Dataset whose ``__getitem__`` returns
one sample (what most Determined trials have), so both loops pay per-sample fetch + collate
and the difference between them is the harness's own per-step Python.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import DataLoader, PyTorchCallback, PyTorchTrial
from det_tasks.sinks import InMemoryMetricsSink


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


class PerSampleDataset(torch.utils.data.Dataset):
    """A map-style dataset with a per-sample ``__getitem__`` (no one-index batch gather)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_data(kind: str, n: int, data: str = "tensor") -> torch.utils.data.Dataset:
    gen = torch.Generator().manual_seed(0)
    shape = (n, 32) if kind == "mlp" else (n, 1, 28, 28)
    x, y = torch.randn(*shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    if data == "map":
        return PerSampleDataset(x, y)
    return torch.utils.data.TensorDataset(x, y)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "mlp":
        return torch.optim.SGD(model.parameters(), lr=0.01)
    return torch.optim.Adadelta(model.parameters(), lr=1.0)


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), so a printed figure names its machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def now() -> float:
    """The bench's clock: wall time, or with ``--clock cpu`` this thread's CPU time (on a
    shared machine other jobs' load then does not count; CPU device and 1 thread only)."""
    return _CLOCK[0]()


_CLOCK = [time.perf_counter]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_only(args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model = make_model(args.model).to(device)
    opt = make_optimizer(args.model, model)
    x, y = make_data(args.model, args.batch_size).tensors  # type: ignore[attr-defined]
    x, y = x.to(device), y.to(device)
    total = torch.zeros((), device=device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync(device)
            start = now()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.detach()
    sync(device)
    return (now() - start) / args.steps


def plain_loop(args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model = make_model(args.model).to(device)
    opt = make_optimizer(args.model, model)
    loader = torch.utils.data.DataLoader(
        make_data(args.model, args.records, args.data),
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
                start = now()
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
                return (now() - start) / args.steps


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
        hp = self.context.hparams
        data = make_data(hp["model"], hp["records"], hp.get("data", "tensor"))
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
        self.stamps.append(now())


def harness(args: argparse.Namespace, device: torch.device) -> float:
    total = args.warmup + args.steps
    clock = _Clock(device)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = pytorch.init(
            hparams={
                "model": args.model,
                "records": args.records,
                "data": args.data,
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument(
        "--data", choices=["tensor", "map"], default="tensor", help="TensorDataset or per-sample"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--records", type=int, default=0, help="dataset size (default 8 batches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="cpu: thread CPU time"
    )
    parser.add_argument(
        "--only",
        choices=["compute_only", "plain_loop", "harness"],
        help="run this way alone (for an instruction count under valgrind)",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    args.records = args.records or args.batch_size * 64
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu":
        if device.type != "cpu" or args.threads != 1:
            parser.error("--clock cpu measures one thread: use it with --device cpu --threads 1")
        _CLOCK[0] = time.thread_time
    ways: dict[str, Callable[[argparse.Namespace, torch.device], float]] = {
        "compute_only": compute_only,
        "plain_loop": plain_loop,
        "harness": harness,
    }
    if args.only:
        ways = {args.only: ways[args.only]}
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            times[name].append(fn(args, device))
    ms = {name: 1000 * statistics.median(v) for name, v in times.items()}
    load = f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}"
    if args.only:
        print(f"{args.only} {ms[args.only]:.4f} ms/step, {args.steps} steps, load {load}")
        return
    result = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
        f"thread(s), torch {torch.__version__}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "clock": args.clock,
        "load": load,  # the 1-minute load average before -> after: others' jobs share the CPU
        "model": args.model,
        "data": args.data,
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
    print(
        f"{result['device']} | {args.model} batch {args.batch_size}, {args.data} data | "
        f"{result['machine']} | {args.clock} clock | load {load}"
    )
    for name, value in ms.items():
        print(f"  {name:13s} {value:8.3f} ms/step")
    print(f"  harness / plain loop   = {result['harness_over_plain']:.3f}")
    print(f"  harness / compute only = {result['harness_over_compute']:.3f}")
    print(f"  plain / compute only   = {result['plain_over_compute']:.3f}")


if __name__ == "__main__":
    main()
