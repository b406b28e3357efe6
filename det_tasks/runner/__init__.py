"""The runner: ``det-tasks run CONFIG [MODEL_DIR]`` trains one trial in this process
(``in_process``), or in N worker processes it starts (``worker_group``); a warm worker holds
a trial between tasks (``held``). Both build trials the same way (``trial_setup``).

Its names load on first use: ``det-tasks`` imports this package for every command, and
``runner.in_process`` imports torch (about 1.4 s), which ``--help`` and ``check-config`` of a
bad file do not need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from det_tasks.runner.entrypoint import load_trial_class
    from det_tasks.runner.in_process import RunResult, run_trial

__all__ = ["RunResult", "load_trial_class", "run_trial"]

_HOMES = {
    "RunResult": "det_tasks.runner.in_process",
    "run_trial": "det_tasks.runner.in_process",
    "load_trial_class": "det_tasks.runner.entrypoint",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
