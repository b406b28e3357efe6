"""The PyTorch MNIST tutorial's trial in Determined's legacy (<= 0.12.12) interface, as the
tutorial writes it: build_model / optimizer / train_batch(batch, model, ...). It runs
unchanged; the harness wraps the model and optimizer and does backward/step itself."""

from typing import Any, Dict, Tuple, cast

import torch
from torch import nn

import determined as det
from determined.pytorch import DataLoader, PyTorchTrial, TorchData, reset_parameters

import data


class Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1)


def error_rate(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    matches = predictions.argmax(1) == labels.to(torch.long)
    return 1.0 - float(matches.sum()) / predictions.shape[0]


class MNistTrial(PyTorchTrial):
    def __init__(self, context: det.TrialContext):
        self.context = context
        self.train_x, self.train_y, self.val_x, self.val_y = data.load_digits_28()

    def build_training_data_loader(self):
        train_data = torch.utils.data.TensorDataset(self.train_x, self.train_y)
        batch_size = self.context.get_per_slot_batch_size()
        return DataLoader(train_data, batch_size=batch_size, shuffle=True)

    def build_validation_data_loader(self):
        validation_data = torch.utils.data.TensorDataset(self.val_x, self.val_y)
        return DataLoader(validation_data, batch_size=self.context.get_per_slot_batch_size())

    def build_model(self):
        model = nn.Sequential(
            nn.Conv2d(1, self.context.get_hparam("n_filters1"), kernel_size=5),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(
                self.context.get_hparam("n_filters1"), self.context.get_hparam("n_filters2"), kernel_size=5,
            ),
            nn.MaxPool2d(2),
            nn.ReLU(),
            Flatten(),
            nn.Linear(16 * self.context.get_hparam("n_filters2"), 50),
            nn.ReLU(),
            nn.Dropout(self.context.get_hparam("dropout")),
            nn.Linear(50, 10),
            nn.LogSoftmax(dim=1),
        )

        reset_parameters(model)
        return model

    def optimizer(self, model: nn.Module):
        return torch.optim.SGD(
            model.parameters(), lr=self.context.get_hparam("learning_rate"), momentum=0.9
        )

    def train_batch(self, batch: TorchData, model: nn.Module, epoch_idx: int, batch_idx: int):
        batch = cast(Tuple[torch.Tensor, torch.Tensor], batch)
        data, labels = batch

        output = model(data)
        loss = torch.nn.functional.nll_loss(output, labels)
        error = error_rate(output, labels)

        return {"loss": loss, "train_error": error}

    def evaluate_batch(self, batch: TorchData, model: nn.Module):
        batch = cast(Tuple[torch.Tensor, torch.Tensor], batch)
        data, labels = batch

        output = model(data)
        error = error_rate(output, labels)

        return {"validation_error": error}
