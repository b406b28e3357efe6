"""Top-level ``determined`` names beyond the training API: constants, error classes, and
clear refusals for the names this compatibility layer does not serve.

Determined 0.38's ``determined/__init__.py`` exports, besides its subpackages: ``LOG_FORMAT``,
``__version__``, ``ClusterInfo``/``TrialInfo``/``get_cluster_info``, ``TrialContext``,
``InvalidHP``, ``errors``, ``core``, and internals of its own master/agent protocol
(``EnvContext``, ``RendezvousInfo``, ``ResourcesInfo``, ``TrialController``,
``ExperimentConfig``) and the hyperparameter classes of its long-removed Python search API.
The first group is served; the rest raise, when used, an error that says what to use.
"""

from __future__ import annotations

import types
from typing import Any, NoReturn

from det_tasks.errors import ConfigError, TrialError

__all__ = [
    "LOG_FORMAT",
    "UNSUPPORTED",
    "errors_module",
    "hint",
    "missing_attribute",
    "unsupported",
]

# The format Determined's log viewer parses (level, process id, logger name); user scripts
# pass it to logging.basicConfig(format=det.LOG_FORMAT).
LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"

UNSUPPORTED = {
    "EnvContext": "Determined's master/agent environment; use det.get_cluster_info() or the "
    "context's get_hparams()/get_experiment_config()",
    "RendezvousInfo": "a Determined agent's rendezvous; distributed workers are started by "
    "torchrun/horovodrun here: use context.distributed (rank, size, local_rank)",
    "ResourcesInfo": "a Determined agent's slot assignment; use context.device and "
    "context.distributed",
    "TrialController": "Determined's internal training loop; write a PyTorchTrial and run it "
    "with det.pytorch.Trainer or `det-tasks run`",
    "ExperimentConfig": "use context.get_experiment_config() (a plain dict)",
    "Categorical": "the Python search-space API was removed from Determined; define the space "
    "under `hyperparameters:` in the experiment YAML ({type: categorical, vals: [...]})",
    "Constant": "define it under `hyperparameters:` in the experiment YAML",
    "Double": "define it under `hyperparameters:` ({type: double, minval, maxval})",
    "Integer": "define it under `hyperparameters:` ({type: int, minval, maxval})",
    "Log": "define it under `hyperparameters:` ({type: log, base, minval, maxval})",
}

_SUBPACKAGES = {
    "determined.keras": "TFKerasTrial is not supported: only PyTorch trials run on det_tasks",
    "determined.estimator": "EstimatorTrial is not supported: only PyTorch trials run here",
    "determined.deepspeed": "DeepSpeedTrial is not supported: write a PyTorchTrial",
    "determined.pytorch.deepspeed": "DeepSpeedTrial is not supported: write a PyTorchTrial "
    "(torch.distributed or Horovod data parallelism via resources.slots_per_trial)",
    "determined.pytorch.dsat": "DeepSpeed autotuning is not supported",
    "determined.pytorch.lightning": "the Lightning adapter is not supported: write a PyTorchTrial",
    "determined.core.ProfilerContext": "the Core API profiler is not supported: the config's "
    "profiling section profiles a PyTorchTrial; time a script's steps yourself",
    "determined.core.ExperimentalCoreContext": "Determined's experimental Core API parts are "
    "not supported: report metrics with core_context.train",
    "determined.core.DummyTrainContext": "core.init() off the platform gives the local "
    "(dummy) parts itself: use core.init()",
    "determined.core.DummyCheckpointContext": "core.init() off the platform gives the local "
    "(dummy) parts itself: use core.init()",
    "determined.core.DummyPreemptContext": "core.init() off the platform gives the local "
    "(dummy) parts itself: use core.init()",
    "determined.core.DummySearcherContext": "core.init() off the platform gives the local "
    "(dummy) parts itself: use core.init()",
    "determined.experimental.Determined": "Determined's Python client is not supported: "
    "query experiments with `det` or MLflow's client (registry.runs.tracking.client_for)",
    "determined.experimental.client": "Determined's Python client is not supported: query "
    "experiments with `det` or MLflow's client",
    "determined.experimental.checkpoint": "use `det checkpoint download` or det_tasks."
    "compat.load_trial_from_checkpoint_path",
}


def unsupported(name: str) -> type:
    """A stand-in class that raises, when instantiated or subclassed, saying what to use."""
    message = f"determined.{name} is not supported by det_tasks: {UNSUPPORTED[name]}"

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(message)

    def refuse_subclass(cls: type, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(message)

    return type(
        name,
        (),
        {
            "__init__": refuse,
            "__init_subclass__": classmethod(refuse_subclass),
            "__doc__": message,
            "__module__": "determined",
        },
    )


def hint(fullname: str) -> str | None:
    """What to use instead of the ``determined.*`` name ``fullname``, where one is known."""
    return _SUBPACKAGES.get(fullname)


def missing_attribute(module: str, served: list[str]) -> Any:
    """A module ``__getattr__`` whose AttributeError names what the module does serve."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        hint = _SUBPACKAGES.get(f"{module}.{name}")
        raise AttributeError(
            f"{module}.{name} is not provided by det_tasks' Determined compatibility layer"
            + (f": {hint}" if hint else f"; it serves {', '.join(sorted(served))}")
        )

    return __getattr__


class InvalidExperimentException(TrialError):
    """``det.errors.InvalidExperimentException``: the trial's setup is invalid."""


class InternalException(TrialError):
    """``det.errors.InternalException``."""


class InvalidConfigurationException(ConfigError):
    """``det.errors.InvalidConfigurationException``."""


class CheckpointNotFoundException(TrialError):
    """``det.errors.CheckpointNotFoundException``."""


def errors_module(make: Any) -> types.ModuleType:
    """``determined.errors`` with the exception classes user code raises or catches."""
    return make(  # type: ignore[no-any-return]
        "determined.errors",
        "Determined's exception classes, mapped onto det_tasks' errors",
        InvalidExperimentException=InvalidExperimentException,
        InternalException=InternalException,
        InvalidConfigurationException=InvalidConfigurationException,
        CheckpointNotFoundException=CheckpointNotFoundException,
    )
