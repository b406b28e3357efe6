"""The module objects ``install()`` registers under ``determined.*``."""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

from det_tasks import cluster_info, pytorch, run_services
from det_tasks.compat import _names
from det_tasks.distributed import DistributedContext
from det_tasks.errors import InvalidHP
from det_tasks.pytorch import Batch, Epoch, experimental, samplers

__all__ = ["InvalidHP", "TorchWriter", "build"]


class TorchWriter:
    """``determined.tensorboard.metric_writers.pytorch.TorchWriter``: a SummaryWriter."""

    def __init__(self, log_dir: str | None = None) -> None:
        if log_dir is None:
            provided = run_services.current_services()
            log_dir = (provided.tensorboard_dir if provided else None) or "runs/tensorboard"
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "TorchWriter needs the tensorboard package: pip install tensorboard"
            ) from None
        self.writer = SummaryWriter(log_dir=log_dir)


def _core_init(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "determined.core.init() (the Core API) is not supported by det_tasks: write the "
        "training as a PyTorchTrial and run it with det.pytorch.init() + Trainer, or "
        "`det-tasks run CONFIG`"
    )


def build() -> dict[str, types.ModuleType]:
    det_pytorch = _module(
        "determined.pytorch",
        pytorch.__doc__ or "",
        **{name: getattr(pytorch, name) for name in pytorch.__all__},
    )
    det_pytorch.samplers = _module(  # type: ignore[attr-defined]
        "determined.pytorch.samplers",
        samplers.__doc__ or "",
        **{name: getattr(samplers, name) for name in samplers.__all__},
    )
    det_pytorch.experimental = _module(  # type: ignore[attr-defined]
        "determined.pytorch.experimental",
        experimental.__doc__ or "",
        **{name: getattr(experimental, name) for name in experimental.__all__},
    )
    core = _module(
        "determined.core", "Core API subset", DistributedContext=DistributedContext, init=_core_init
    )
    writers_pytorch = _module(
        "determined.tensorboard.metric_writers.pytorch", "", TorchWriter=TorchWriter
    )
    writers = _module("determined.tensorboard.metric_writers", "", pytorch=writers_pytorch)
    tensorboard = _module("determined.tensorboard", "", metric_writers=writers)
    errors = _names.errors_module(_module)
    det = _module(
        "determined",
        "det_tasks' implementation of the determined package API",
        pytorch=det_pytorch,
        core=core,
        tensorboard=tensorboard,
        errors=errors,
        TrialContext=pytorch.PyTorchTrialContext,
        LegacyTrial=pytorch.PyTorchTrial,
        Trial=pytorch.PyTorchTrial,
        InvalidHP=InvalidHP,
        get_cluster_info=cluster_info.get_cluster_info,
        ClusterInfo=cluster_info.ClusterInfo,
        TrialInfo=cluster_info.TrialInfo,
        LOG_FORMAT=_names.LOG_FORMAT,
        Batches=Batch,
        Epochs=Epoch,
        __version__="0.38.1+det_tasks",
        **{name: _names.unsupported(name) for name in _names.UNSUPPORTED},
    )
    for module in (det, det_pytorch):
        served = [n for n in vars(module) if not n.startswith("_")]
        module.__dict__["__getattr__"] = _names.missing_attribute(module.__name__, served)
    return {
        "determined": det,
        "determined.errors": errors,
        "determined.pytorch": det_pytorch,
        "determined.pytorch.samplers": det_pytorch.samplers,  # type: ignore[attr-defined]
        "determined.pytorch.experimental": det_pytorch.experimental,  # type: ignore[attr-defined]
        "determined.core": core,
        "determined.tensorboard": tensorboard,
        "determined.tensorboard.metric_writers": writers,
        "determined.tensorboard.metric_writers.pytorch": writers_pytorch,
    }


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attrs)
    module.__det_tasks_compat__ = True  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    return module
