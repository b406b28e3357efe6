"""The working directory a trial's code runs in: its model directory.

Determined runs every trial in a copy of its model directory (``/run/determined/workdir``),
so trial code opens files that ship beside ``model_def.py`` by relative path
(``open("labels.txt")``), at import or in ``__init__``. Here the trial's code runs in the
model directory itself, for each stretch of it (import, build, a step, shutdown), and the
process's own directory comes back after: the paths a user typed (config, checkpoint
folder, tracking URI) keep meaning what they meant where the command was run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["in_model_dir"]


@contextlib.contextmanager
def in_model_dir(model_dir: Path) -> Iterator[None]:
    """Run the block with ``model_dir`` as the working directory, then go back (to where
    the process was; a directory deleted meanwhile stays left)."""
    try:
        previous: str | None = os.getcwd()
    except FileNotFoundError:  # the directory this process was in is gone
        previous = None
    os.chdir(model_dir)
    try:
        yield
    finally:
        if previous is not None:
            with contextlib.suppress(OSError):
                os.chdir(previous)
