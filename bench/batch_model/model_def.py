"""The benchmark's model and dataset: an MLP (784-256-10) over synthetic 784-feature records.

Record i is row ``i % 1024`` of a fixed table, so the dataset's memory is the same at any
size (what the peak-memory figure needs) and a record costs the same in the flow and in
the plain loop. ``model_def:records_<n>`` is the dataset of n records.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from det_tasks.pytorch import DataLoader, PyTorchTrial

FEATURES = 784


class Records(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.table = torch.rand(1024, FEATURES, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.table[i % 1024]


def __getattr__(name: str) -> Any:
    """``model_def:records_<n>``: the dataset of n records (worker processes fork from a
    server started earlier, so the size travels in the spec, not in the environment)."""
    prefix, _, n = name.partition("_")
    if prefix == "records" and n.isdigit():
        return lambda: Records(int(n))
    raise AttributeError(name)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 10))


class MlpTrial(PyTorchTrial):
    def __init__(self, context) -> None:
        self.context = context
        self.model = context.wrap_model(mlp())
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.0))

    def train_batch(self, batch, epoch_idx, batch_idx):
        loss = self.model(batch).pow(2).mean()
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch):
        return {"validation_loss": self.model(batch).pow(2).mean()}

    def build_training_data_loader(self):
        return DataLoader(Records(64), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self):
        return DataLoader(Records(64), batch_size=self.context.get_per_slot_batch_size())
