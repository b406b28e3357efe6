"""A compute-bound conv net on synthetic 32x32 images (FACTS' scaling model): the gradient
allreduce is small next to the convolutions, so scaling measures the harness, not Gloo."""

from typing import Any

import torch
from determined import pytorch
from determined.pytorch import DataLoader, PyTorchTrial
from torch import nn


class Images(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 32, 32, generator=gen)
        self.y = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ConvTrial(PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        ))  # fmt: skip
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01))

    def build_training_data_loader(self) -> DataLoader:
        return DataLoader(Images(2048), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self) -> DataLoader:
        return DataLoader(Images(64), batch_size=64)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> Any:
        x, y = batch
        return {"val_loss": nn.functional.cross_entropy(self.model(x), y)}
