"""The installation's own folder: ``$DET_TASKS_HOME``, else ``~/.det_tasks``. It holds what
belongs to this installation rather than to a run: the checkpoint signing key, and the
no-server mode's MLflow store and artifacts."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOME_ENV", "det_tasks_home"]

HOME_ENV = "DET_TASKS_HOME"


def det_tasks_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".det_tasks").expanduser()
