"""``TorchBatchProcessorContext``: what a ``TorchBatchProcessor`` sees (Determined 0.38's API).

Device, model preparation, ``upload_path()`` (files land in the job's output: its S3 prefix,
or the local job directory), metrics to the job's run, lineage tags and custom reducers.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from det_tasks import cluster_info
from det_tasks.distributed import DistributedContext
from det_tasks.errors import TrialError
from det_tasks.pytorch._api.reducer import MetricReducer, as_metric_reducer, to_python
from det_tasks.pytorch._data.loader import to_device
from det_tasks.pytorch.experimental._job_services import BatchJobServices

__all__ = ["TorchBatchProcessorContext"]

log = logging.getLogger(__name__)


def default_device(distributed: DistributedContext) -> torch.device:
    """One GPU per local rank when there are GPUs, else the CPU (as Determined chose)."""
    if torch.cuda.device_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", distributed.get_local_rank())


class TorchBatchProcessorContext:
    """Built by ``torch_batch_process`` and handed to the processor's ``__init__``."""

    def __init__(
        self,
        distributed: DistributedContext,
        services: BatchJobServices,
        storage_path: str,
        hparams: dict[str, Any] | None = None,
    ) -> None:
        self.distributed = distributed
        self.device = default_device(distributed)
        self._services = services
        self._storage_path = storage_path
        self._hparams = dict(hparams or {})
        self._use_default_storage = False
        self._wrapped_reducers: list[MetricReducer] = []
        self._reducer_names: list[str | None] = []

    # ---- data and model ---------------------------------------------------------------
    def to_device(self, data: Any, warned_types: set[type] | None = None) -> Any:
        """Every tensor (and numpy array) in ``data`` moved to this process's device."""
        return to_device(data, self.device)

    def prepare_model_for_inference(self, model: nn.Module) -> nn.Module:
        """Eval mode, on this process's device."""
        model.eval()
        model.to(self.device)
        return model

    def get_hparams(self) -> dict[str, Any]:
        return dict(self._hparams)

    def get_distributed_rank(self) -> int:
        return self.distributed.get_rank()

    def get_distributed_size(self) -> int:
        return self.distributed.get_size()

    def get_tensorboard_path(self) -> Path:
        """Event files written here are kept with the job (MLflow ``tensorboard/``)."""
        return self._services.tensorboard_dir()

    # ---- outputs ----------------------------------------------------------------------
    @contextlib.contextmanager
    def upload_path(self) -> Iterator[Path]:
        """A fresh local directory; on leaving the block its files are stored under
        ``<job output>/<output uuid>/rank_<rank>/`` (Determined's default storage path)."""
        self._use_default_storage = True
        local = Path(tempfile.mkdtemp(prefix="det-tasks-upload-"))
        try:
            yield local
            if any(p.is_file() for p in local.rglob("*")):
                self._services.upload(local, self._storage_path)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Metrics of this job under ``group`` (``training``, ``validation`` or your own)."""
        if not group or "." in group:
            raise ValueError(f"metrics group {group!r} must be non-empty and contain no '.'")
        self._services.report_metrics(group, steps_completed, {**metrics})

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        """Record that this job used ``checkpoint`` (a uuid, a URI, or an object with
        ``uuid``): the tag ``det.uses_checkpoint`` on the job's run."""
        ref = checkpoint if isinstance(checkpoint, str) else getattr(checkpoint, "uuid", None)
        if not ref:
            raise TypeError(
                f"report_task_using_checkpoint takes a checkpoint uuid, URI or an object with "
                f"`uuid`, got {checkpoint!r}"
            )
        self._services.set_tag("det.uses_checkpoint", str(ref))

    def report_task_using_model_version(self, model_version: Any) -> None:
        """Record that this job used a registered model version: ``det.uses_model_version``
        = ``models:/<name>/<version>`` (or the string given)."""
        if isinstance(model_version, str):
            ref = model_version
        else:
            name = getattr(model_version, "name", None) or getattr(
                model_version, "model_name", None
            )
            version = getattr(model_version, "version", None) or getattr(
                model_version, "model_version", None
            )
            if name is None or version is None:
                raise TypeError(
                    "report_task_using_model_version takes `models:/name/version` or an object "
                    f"with `name` and `version`, got {model_version!r}"
                )
            ref = f"models:/{name}/{version}"
        self._services.set_tag("det.uses_model_version", ref)

    # ---- reducers ---------------------------------------------------------------------
    def wrap_reducer(
        self, reducer: Callable[[list[Any]], Any] | MetricReducer, name: str | None = None
    ) -> MetricReducer:
        """A reducer whose result is reported (as validation metrics) when the job ends."""
        reducer = as_metric_reducer(reducer)
        self._wrapped_reducers.append(reducer)
        self._reducer_names.append(name)
        return reducer

    def run_cross_slot_reduction(
        self, reducables: list[MetricReducer], gathered: list[list[Any]]
    ) -> dict[str, Any]:
        """Every slot's per-slot summaries (``gathered[slot][i]``) reduced per reducer."""
        out: dict[str, Any] = {}
        for i, reducer in enumerate(reducables):
            value = reducer.cross_slot_reduce([slot[i] for slot in gathered])
            name = self._reducer_names[self._wrapped_reducers.index(reducer)]
            if name is None:
                if not isinstance(value, dict):
                    raise TrialError(
                        f"reducer {type(reducer).__name__} was wrapped without a name, so "
                        f"cross_slot_reduce must return a dict of metrics; got {value!r}"
                    )
                out.update({k: to_python(v) for k, v in value.items()})
            else:
                out[name] = to_python(value)
        return out


def hparams_of_job() -> dict[str, Any]:
    info = cluster_info.get_cluster_info()
    return dict(info.trial.hparams) if info is not None else {}
