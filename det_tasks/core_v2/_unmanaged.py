"""The unmanaged ``core.Context``: a ``det_tasks.core`` context built on services the
platform's ``det_tasks.unmanaged_runs`` entry point opens (registry.jobs.unmanaged_runs: the
MLflow runs, the S3 store), which it ends when the context closes: COMPLETED, or ERROR
when it closes on an exception."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from det_tasks import core, plugins, run_services
from det_tasks.core_v2._config import Config, raw_config
from det_tasks.errors import ConfigError

__all__ = ["UnmanagedContext", "open_unmanaged"]


class UnmanagedContext(core.Context):
    """A ``core.Context`` that also ends its run: ``close(exc_type, exc, tb)``."""

    _resources: contextlib.ExitStack
    _services: run_services.RunServices
    _closed = False

    def close(self, *exc_info: Any) -> None:
        if self._closed:
            return
        self._closed = True
        exc = exc_info if len(exc_info) == 3 and exc_info[0] is not None else (None, None, None)
        try:
            super().close(*exc_info)
            if exc[0] is None:  # the script ended its run itself: it is complete
                trained = self.train_steps()
                self._services.record_position(trained, trained, False)
        except BaseException:
            self._resources.__exit__(*sys.exc_info())
            raise
        self._resources.__exit__(*exc)

    def train_steps(self) -> int:
        return int(self._services.control.steps_completed)


def open_unmanaged(config: Config, **core_kwargs: Any) -> UnmanagedContext:
    """Open the run's services and build the context on them (not started yet)."""
    if config.checkpoint_storage is not None or core_kwargs.get("checkpoint_storage"):
        raise ConfigError(
            "core_v2.init(checkpoint_storage=...) is not supported in unmanaged mode: the "
            "run's checkpoints go to the platform's S3 store; leave checkpoint_storage out"
        )
    factory = plugins.load_one("det_tasks.unmanaged_runs", "mlflow")
    if factory is None:
        raise ConfigError(
            "core_v2.init(): unmanaged mode needs the platform extra (the registry package): "
            "pip install -e '.[platform]'"
        )
    resources = contextlib.ExitStack()
    try:
        services = resources.enter_context(
            factory(
                raw_config(config),
                dict(config.hparams or {}),
                script=_main_script(),
                external_experiment_id=config.external_experiment_id,
                external_trial_id=config.external_trial_id,
            )
        )
        resources.enter_context(run_services.provide(services))
        context = core.init(**core_kwargs)
    except BaseException:
        resources.__exit__(*sys.exc_info())
        raise
    unmanaged = UnmanagedContext(
        context.checkpoint,
        context.distributed,
        context.preempt,
        context.train,
        context.searcher,
        context.info,
    )
    unmanaged._resources = resources
    unmanaged._services = services
    return unmanaged


def _main_script() -> Path | None:
    """The script that was started (``python train.py``), for the run's code version."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(main).resolve() if main else None
