"""``import determined`` for trial code written against Determined, served by det_tasks.

``install()`` registers the ``determined`` package names in ``sys.modules`` unless the
real Determined is importable (then it is left alone). Submodules we do not provide fail
with an ImportError that says so, instead of a confusing AttributeError later.

This package sits above ``det_tasks.pytorch`` (it builds ``determined.pytorch`` from it) and
nothing there imports it: a caller that loads checkpoints whose code imports
``determined`` uses ``load_trial_from_checkpoint_path`` from here, which installs first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any

from det_tasks import pytorch
from det_tasks.compat import _names

__all__ = ["install", "is_installed", "load_trial_from_checkpoint_path"]

_PREFIX = "determined"


def _real_determined_available() -> bool:
    if sys.modules.get(_PREFIX) is not None and not getattr(
        sys.modules[_PREFIX], "__det_tasks_compat__", False
    ):
        return True
    try:
        return importlib.util.find_spec(_PREFIX) is not None and not is_installed()
    except (ImportError, ValueError):
        return False


def is_installed() -> bool:
    return getattr(sys.modules.get(_PREFIX), "__det_tasks_compat__", False)


# Aliases imported only when asked for: their modules import an optional extra.
_LAZY = {"determined.transformers": "det_tasks.transformers"}


class _AliasLoader(importlib.abc.Loader):
    """Serves a ``determined.*`` name with a det_tasks module, imported on first use."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        """The target module ran when it was imported."""


class _Refuser(importlib.abc.MetaPathFinder):
    """Serves the lazy aliases, and explains which ``determined.*`` modules the
    compatibility layer does not provide."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in _LAZY and is_installed() and fullname not in sys.modules:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(_LAZY[fullname]))
        if fullname.startswith(_PREFIX + ".") and is_installed() and fullname not in sys.modules:
            hint = _names.hint(fullname)
            raise ImportError(
                f"{fullname} is not provided by det_tasks' Determined compatibility layer"
                + (
                    f": {hint}"
                    if hint
                    else "; it serves determined, determined.pytorch (+ samplers, "
                    "experimental), determined.core (the Core API), "
                    "determined.experimental.core_v2, determined.transformers, "
                    "determined.tensorboard.metric_writers.pytorch"
                )
            )
        return None


def install() -> bool:
    """Make ``import determined`` resolve to det_tasks; False if real Determined is present."""
    if is_installed():
        return True
    if _real_determined_available():
        return False
    from det_tasks.compat import _modules

    for name, module in _modules.build().items():
        sys.modules[name] = module
    if not any(isinstance(f, _Refuser) for f in sys.meta_path):
        sys.meta_path.append(_Refuser())
    return True


def load_trial_from_checkpoint_path(
    path: str | Path,
    trial_class: type | None = None,
    trial_kwargs: dict[str, Any] | None = None,
    torch_load_kwargs: dict[str, Any] | None = None,
    hparams: dict[str, Any] | None = None,
    trust_code: bool = False,
) -> Any:
    """``det_tasks.pytorch.load_trial_from_checkpoint_path`` for checkpoints whose code
    imports ``determined``: the alias is installed before that code is imported."""
    return pytorch.load_trial_from_checkpoint_path(
        path,
        trial_class=trial_class,
        trial_kwargs=trial_kwargs,
        torch_load_kwargs=torch_load_kwargs,
        hparams=hparams,
        trust_code=trust_code,
        prepare_imports=install,
    )
