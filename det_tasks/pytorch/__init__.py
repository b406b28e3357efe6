"""The ``determined.pytorch`` 0.38 API, implemented on plain torch.

Trial code written for Determined imports these names unchanged (``det_tasks.compat``
aliases ``determined.pytorch`` to this module).
"""

from det_tasks.pytorch import samplers
from det_tasks.pytorch._callback import PyTorchCallback
from det_tasks.pytorch._context import PyTorchExperimentalContext, PyTorchTrialContext
from det_tasks.pytorch._data import (
    DataLoader,
    TorchData,
    adapt_batch_sampler,
    data_length,
    to_device,
)
from det_tasks.pytorch._legacy import reset_parameters
from det_tasks.pytorch._load import CheckpointLoadContext, load_trial_from_checkpoint_path
from det_tasks.pytorch._lr_scheduler import LRScheduler
from det_tasks.pytorch._reducer import MetricReducer, Reducer
from det_tasks.pytorch._trainer import FitResult, Trainer, init
from det_tasks.pytorch._trial import PyTorchTrial
from det_tasks.pytorch._units import Batch, Epoch, TrainUnit

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
