"""The module objects ``install()`` registers under ``determined.*``."""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

from det_tasks import cluster_info, core, core_v2, pytorch, run_services
from det_tasks.compat import _names
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
    det_core = _public("determined.core", core)
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
        core=det_core,
        tensorboard=tensorboard,
        errors=errors,
        experimental=_experimental(),
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
    for module in (det, det_pytorch, det_core, det.experimental):
        served = [n for n in vars(module) if not n.startswith("_")]
        module.__dict__["__getattr__"] = _names.missing_attribute(module.__name__, served)
    return {
        "determined": det,
        "determined.errors": errors,
        "determined.pytorch": det_pytorch,
        "determined.pytorch.samplers": det_pytorch.samplers,  # type: ignore[attr-defined]
        "determined.pytorch.experimental": det_pytorch.experimental,  # type: ignore[attr-defined]
        "determined.core": det_core,
        "determined.experimental": det.experimental,  # type: ignore[attr-defined]
        "determined.experimental.core_v2": core_v2,
        "determined.tensorboard": tensorboard,
        "determined.tensorboard.metric_writers": writers,
        "determined.tensorboard.metric_writers.pytorch": writers_pytorch,
    }


def _experimental() -> types.ModuleType:
    """``determined.experimental``: its ``core_v2`` is the package itself, not a copy, as
    ``core_v2.init()`` sets the package's globals (``core_v2.train``...)."""
    return _module(
        "determined.experimental", "Determined's experimental API: core_v2", core_v2=core_v2
    )


def _public(name: str, package: types.ModuleType) -> types.ModuleType:
    """``package``'s public names (its ``__all__``) as the alias module ``name``."""
    return _module(name, package.__doc__ or "", **{n: getattr(package, n) for n in package.__all__})


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attrs)
    module.__det_tasks_compat__ = True  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    return module
