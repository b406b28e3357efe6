"""``import determined`` for trial code written against Determined, served by det_tasks.

``install()`` registers the ``determined`` package names in ``sys.modules`` unless the
real Determined is importable (then it is left alone). Submodules we do not provide fail
with an ImportError that says so, instead of a confusing AttributeError later.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["install", "is_installed"]

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


class _Refuser(importlib.abc.MetaPathFinder):
    """Explains which ``determined.*`` modules the compatibility layer does not provide."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(_PREFIX + ".") and is_installed() and fullname not in sys.modules:
            raise ImportError(
                f"{fullname} is not provided by det_tasks' Determined compatibility layer; "
                "it serves determined, determined.pytorch (+ samplers, experimental), "
                "determined.core (DistributedContext), "
                "determined.tensorboard.metric_writers.pytorch"
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


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attrs)
    module.__det_tasks_compat__ = True  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    return module
