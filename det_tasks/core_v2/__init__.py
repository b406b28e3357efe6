"""Determined's ``determined.experimental.core_v2``: the Core API in one module's globals.

``core_v2.init(config=core_v2.Config(name=...))`` in a plain script, started by hand
anywhere, makes an unmanaged run: an experiment of one trial on the platform (MLflow runs,
S3 checkpoints, listed by ``det experiment list``) that no flow submitted; then
``core_v2.train``, ``core_v2.checkpoint``... are its ``core.Context``'s parts, and
``core_v2.close()`` (or the interpreter's exit) ends it: COMPLETED, or ERROR when the
script ends on an uncaught exception. In a launched trial (``det-tasks run``, a flow) the
config is ignored and the trial's own context is used, as in Determined."""

from __future__ import annotations

import atexit
import sys
import types
from typing import Any

from det_tasks import cluster_info, core
from det_tasks.core import DistributedContext, PreemptMode, TensorboardMode
from det_tasks.core_v2._config import Config, DefaultConfig, UnmanagedConfig, merge_config
from det_tasks.core_v2._unmanaged import UnmanagedContext, open_unmanaged

__all__ = [
    "Config",
    "DefaultConfig",
    "DistributedContext",
    "PreemptMode",
    "TensorboardMode",
    "UnmanagedConfig",
    "UnmanagedContext",
    "checkpoint",
    "close",
    "distributed",
    "info",
    "init",
    "init_context",
    "preempt",
    "searcher",
    "train",
    "url_reverse_webui_exp_view",
]

# The singleton's parts, set by init() and cleared by close() (Determined's globals).
train: core.TrainContext | None = None
checkpoint: core.CheckpointContext | None = None
distributed: core.DistributedContext | None = None
preempt: core.PreemptContext | None = None
searcher: core.SearcherContext | None = None
info: cluster_info.ClusterInfo | None = None

_context: core.Context | None = None
_exit_hooks_installed = False
_uncaught: tuple[Any, Any, Any] | None = None


def init_context(
    *,
    config: Config | None = None,
    defaults: Config | None = None,
    unmanaged: Config | None = None,
    client: Any = None,
    distributed: core.DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: core.PreemptMode = core.PreemptMode.WorkersAskChief,
    tensorboard_mode: core.TensorboardMode = core.TensorboardMode.AUTO,
) -> core.Context:
    """A context for ``with core_v2.init_context(config=...) as core_context:``: the
    launched trial's, or an unmanaged run's, ended with the block (ERROR if it raises)."""
    if client is not None:
        raise NotImplementedError(
            "core_v2.init(client=...) is not supported by det_tasks: there is no Determined "
            "master; the platform is found from MLFLOW_TRACKING_URI and PREFECT_API_URL"
        )
    merged = merge_config(config, defaults, unmanaged)
    kwargs: dict[str, Any] = {
        "distributed": distributed,
        "checkpoint_storage": checkpoint_storage,
        "preempt_mode": preempt_mode,
        "tensorboard_mode": tensorboard_mode,
    }
    if cluster_info.get_cluster_info() is not None or merged is None:
        return core.init(**kwargs)  # a launched trial: its experiment's config rules
    return open_unmanaged(merged, **kwargs)


def init(
    *,
    config: Config | None = None,
    defaults: Config | None = None,
    unmanaged: Config | None = None,
    client: Any = None,
    distributed: core.DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: core.PreemptMode = core.PreemptMode.WorkersAskChief,
    tensorboard_mode: core.TensorboardMode = core.TensorboardMode.AUTO,
) -> None:
    """``init_context``'s context, started and kept in this module's globals until
    ``close()`` (called at the interpreter's exit too)."""
    global _context
    if _context is not None:
        close()
    context = init_context(
        config=config,
        defaults=defaults,
        unmanaged=unmanaged,
        client=client,
        distributed=distributed,
        checkpoint_storage=checkpoint_storage,
        preempt_mode=preempt_mode,
        tensorboard_mode=tensorboard_mode,
    )
    context.start()
    _context = context
    _set_parts(context)
    _install_exit_hooks()


def close() -> None:
    """End the singleton's context (and an unmanaged run: COMPLETED, or ERROR after an
    uncaught exception); a no-op when none is open."""
    global _context
    context, _context = _context, None
    _set_parts(None)
    if context is not None:
        context.close(*(_uncaught or (None, None, None)))


def url_reverse_webui_exp_view() -> str:
    """Where the run can be seen: its MLflow page."""
    services = getattr(_context, "_services", None)
    url = services.run_url if services is not None else None
    if not url:
        raise RuntimeError("core_v2.url_reverse_webui_exp_view(): no unmanaged run is open")
    return str(url)


def _set_parts(context: core.Context | None) -> None:
    module = sys.modules[__name__]
    for part in ("train", "checkpoint", "distributed", "preempt", "searcher", "info"):
        setattr(module, part, getattr(context, part) if context is not None else None)


def _install_exit_hooks() -> None:
    """close() at exit; an uncaught exception is remembered first, so the run ends ERROR."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    previous = sys.excepthook

    def remember(
        kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
    ) -> None:
        global _uncaught
        _uncaught = (kind, value, tb)
        previous(kind, value, tb)

    sys.excepthook = remember
    atexit.register(close)
