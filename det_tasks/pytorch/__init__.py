"""The ``determined.pytorch`` 0.38 API, implemented on plain torch.

Trial code written for Determined imports these names unchanged (``det_tasks.compat``
aliases ``determined.pytorch`` to this module).
"""

from det_tasks.pytorch import samplers
from det_tasks.pytorch._api.callback import PyTorchCallback
from det_tasks.pytorch._api.context import PyTorchExperimentalContext, PyTorchTrialContext
from det_tasks.pytorch._api.legacy import reset_parameters
from det_tasks.pytorch._api.lr_scheduler import LRScheduler
from det_tasks.pytorch._api.reducer import MetricReducer, Reducer
from det_tasks.pytorch._api.trial import PyTorchTrial
from det_tasks.pytorch._data.loader import (
    DataLoader,
    TorchData,
    adapt_batch_sampler,
    data_length,
    to_device,
)
from det_tasks.pytorch._data.units import Batch, Epoch, TrainUnit
from det_tasks.pytorch._loading.load import CheckpointLoadContext, load_trial_from_checkpoint_path
from det_tasks.pytorch._trainer import FitResult, Trainer, init

__all__ = [
    "Batch",
    "CheckpointLoadContext",
    "DataLoader",
    "Epoch",
    "FitResult",
    "LRScheduler",
    "MetricReducer",
    "PyTorchCallback",
    "PyTorchExperimentalContext",
    "PyTorchTrial",
    "PyTorchTrialContext",
    "Reducer",
    "TorchData",
    "TrainUnit",
    "Trainer",
    "adapt_batch_sampler",
    "data_length",
    "init",
    "load_trial_from_checkpoint_path",
    "reset_parameters",
    "samplers",
    "to_device",
]
