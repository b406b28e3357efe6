"""The PyTorch MNIST tutorial's model as a PyTorchTrial (current API)."""

from __future__ import annotations

from typing import Any

import data
import torch
from determined import pytorch
from determined.pytorch import DataLoader, PyTorchTrial, PyTorchTrialContext
from torch import nn


def error_rate(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return 1.0 - (predictions.argmax(1) == labels).float().mean()


class MNistTrial(PyTorchTrial):
    def __init__(self, context: PyTorchTrialContext) -> None:
        self.context = context
        path = self.context.get_data_config().get("path")
        if path:
            self.train_x, self.train_y, self.val_x, self.val_y = data.load_mnist_idx(path)
        else:
            self.train_x, self.train_y, self.val_x, self.val_y = data.load_digits_28()
        n1 = self.context.get_hparam("n_filters1")
        n2 = self.context.get_hparam("n_filters2")
        self.model = self.context.wrap_model(
            nn.Sequential(
                nn.Conv2d(1, n1, kernel_size=5),
                nn.MaxPool2d(2),
                nn.ReLU(),
                nn.Conv2d(n1, n2, kernel_size=5),
                nn.MaxPool2d(2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(16 * n2, 50),
                nn.ReLU(),
                nn.Dropout(self.context.get_hparam("dropout")),
                nn.Linear(50, 10),
                nn.LogSoftmax(dim=1),
            )
        )
        self.optimizer = self.context.wrap_optimizer(
            torch.optim.Adadelta(
                self.model.parameters(), lr=self.context.get_hparam("learning_rate")
            )
        )

    def build_training_data_loader(self) -> DataLoader:
        dataset = torch.utils.data.TensorDataset(self.train_x, self.train_y)
        return DataLoader(
            dataset, batch_size=self.context.get_per_slot_batch_size(), shuffle=True, drop_last=True
        )

    def build_validation_data_loader(self) -> DataLoader:
        dataset = torch.utils.data.TensorDataset(self.val_x, self.val_y)
        return DataLoader(dataset, batch_size=self.context.get_per_slot_batch_size())

    def train_batch(
        self, batch: pytorch.TorchData, epoch_idx: int, batch_idx: int
    ) -> dict[str, Any]:
        data_, labels = batch
        output = self.model(data_)
        loss = nn.functional.nll_loss(output, labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss, "train_error": error_rate(output, labels)}

    def evaluate_batch(self, batch: pytorch.TorchData) -> dict[str, Any]:
        data_, labels = batch
        output = self.model(data_)
        return {
            "validation_loss": nn.functional.nll_loss(output, labels),
            "validation_error": error_rate(output, labels),
            "accuracy": 1.0 - error_rate(output, labels),
        }
