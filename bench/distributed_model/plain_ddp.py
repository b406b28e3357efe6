"""The same conv net and global batch in a plain DDP loop (no harness), for comparison.
Run under torchrun (2 workers) or plainly (1 process); prints samples/s from rank 0."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS, WARMUP, GLOBAL_BATCH = 60, 5, 64

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model: nn.Module = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
)  # fmt: skip
if world > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(GLOBAL_BATCH // world, 3, 32, 32)
y = torch.randint(0, 10, (GLOBAL_BATCH // world,))


def step() -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


for _ in range(WARMUP):
    step()
started = time.perf_counter()
for _ in range(STEPS):
    step()
elapsed = time.perf_counter() - started
if int(os.environ.get("RANK", "0")) == 0:
    print(f"{STEPS * GLOBAL_BATCH / elapsed:.1f}")
