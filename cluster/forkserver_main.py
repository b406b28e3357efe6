"""Imported first in the warm workers' forkserver (cluster.warm_forkserver): marks the
forkserver's ``__main__`` as the run's main module (``python -m NAME``), so the workers it
forks do not run that module again as ``__mp_main__`` (multiprocessing skips it when the
name matches: ``spawn._fixup_main_from_name``). A worker needs nothing of it: it runs
cluster steps, and Dask pickles what ``__main__`` defines by value. Without this, every
worker (or the forkserver, once) imported Prefect through ``flows.experiment``."""

from __future__ import annotations

import importlib.machinery
import os
import sys

from cluster.warm_forkserver import MAIN_MODULE_ENV

__all__: list[str] = []

_name = os.environ.get(MAIN_MODULE_ENV)
_main = sys.modules["__main__"]
if _name and getattr(_main, "__spec__", None) is None:  # the forkserver's own `-c` main
    _main.__spec__ = importlib.machinery.ModuleSpec(_name, None)
