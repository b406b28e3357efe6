"""Determined's Core API (``determined.core``) for scripts: ``with core.init() as
core_context:`` reports metrics, stores and restores checkpoints, follows the searcher and
hears pause and preemption through the trial's one services object
(``det_tasks.run_services``), on the platform or, off it, with local parts."""

from __future__ import annotations

from det_tasks.core._checkpoint import CheckpointContext, DownloadMode
from det_tasks.core._context import Context, init
from det_tasks.core._distributed import DistributedContext, DummyDistributedContext
from det_tasks.core._preempt import PreemptContext, PreemptMode
from det_tasks.core._searcher import SearcherContext, SearcherMode, SearcherOperation, Unit
from det_tasks.core._train import EarlyExitReason, TensorboardMode, TrainContext

__all__ = [
    "CheckpointContext",
    "Context",
    "DistributedContext",
    "DownloadMode",
    "DummyDistributedContext",
    "EarlyExitReason",
    "PreemptContext",
    "PreemptMode",
    "SearcherContext",
    "SearcherMode",
    "SearcherOperation",
    "TensorboardMode",
    "TrainContext",
    "Unit",
    "init",
]
