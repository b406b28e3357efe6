"""``determined.pytorch.experimental``: Determined's batch-processing API on det_tasks.

Scripts written for Determined (``from determined.pytorch import experimental``) run
unchanged: locally, through ``det-tasks job run``, and under
``python3 -m determined.launch.torch_distributed`` with ``resources.slots_per_trial: N``.
"""

from det_tasks.pytorch.experimental._batch_context import TorchBatchProcessorContext
from det_tasks.pytorch.experimental._batch_process import TorchBatchProcessor, torch_batch_process
from det_tasks.pytorch.experimental._job_services import (
    BatchJobServices,
    LocalJobServices,
)

__all__ = [
    "BatchJobServices",
    "LocalJobServices",
    "TorchBatchProcessor",
    "TorchBatchProcessorContext",
    "torch_batch_process",
]
