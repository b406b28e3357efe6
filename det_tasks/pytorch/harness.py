"""What the platform's runners use of the PyTorch harness: the trial controller, the
checkpoint store a config names, lengths as units, checkpoint files, code trust and the
batch jobs' environment. Not Determined's API (trial code never needs these), so kept out of
``det_tasks.pytorch``'s namespace; the runners (``det_tasks.runner``, ``cluster``, ``flows``,
``registry``, ``bench``) import them from here, never from the private modules."""

from __future__ import annotations

from det_tasks.pytorch._loading.load import check_code_trusted
from det_tasks.pytorch._loop.checkpointing import CheckpointFiles, CheckpointWriter
from det_tasks.pytorch._loop.restore import open_checkpoint
from det_tasks.pytorch._trainer import length_to_unit, store_from_config, trial_controller
from det_tasks.pytorch.experimental.job_environment import JOB_ID_ENV, JOB_OUTPUT_ENV

__all__ = [
    "JOB_ID_ENV",
    "JOB_OUTPUT_ENV",
    "CheckpointFiles",
    "CheckpointWriter",
    "check_code_trusted",
    "length_to_unit",
    "open_checkpoint",
    "store_from_config",
    "trial_controller",
]
