"""Resolving an experiment's ``entrypoint``: ``module:TrialClass`` or a Python script."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from det_tasks.errors import ConfigError, DetTasksError, TrialError

__all__ = [
    "import_failure",
    "load_trial_class",
    "load_trial_class_or_fail",
    "model_dir_on_path",
    "no_module_error",
    "parse_script_command",
    "split_trial_entrypoint",
    "syntax_error",
]


def split_trial_entrypoint(entrypoint: str) -> tuple[str, str]:
    """``module:Class`` as (module, class path), refused in one line in any other form."""
    module_name, _, class_path = entrypoint.partition(":")
    if not module_name or not class_path:
        raise ConfigError(
            f"entrypoint {entrypoint!r} is not of the form `module:TrialClass` "
            "(e.g. `model_def:MNistTrial`)"
        )
    return module_name, class_path


def syntax_error(entrypoint: str, err: SyntaxError) -> TrialError:
    """The entrypoint's module does not parse: where, in the compiler's words."""
    return TrialError(f"entrypoint {entrypoint!r}: {err.filename}:{err.lineno}: {err.msg}")


def no_module_error(entrypoint: str, module_name: str, model_dir: Path) -> ConfigError:
    """The entrypoint's module is not in the model directory: which folder to pass."""
    return ConfigError(
        f"entrypoint {entrypoint!r}: no module {module_name!r} in model directory "
        f"{str(model_dir)!r}; pass the directory holding {module_name}.py"
    )


def load_trial_class(entrypoint: str, model_dir: Path) -> type:
    """Import ``module:Class`` from ``model_dir`` (with ``determined`` aliased to us)."""
    from det_tasks import compat

    compat.install()
    module_name, class_path = split_trial_entrypoint(entrypoint)
    model_dir = model_dir.resolve()
    if str(model_dir) not in sys.path:
        raise RuntimeError("load_trial_class must run inside model_dir_on_path(model_dir)")
    sys.modules.pop(module_name, None)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as err:
        raise syntax_error(entrypoint, err) from None
    except ModuleNotFoundError as err:
        if err.name == module_name.split(".")[0]:
            raise no_module_error(entrypoint, module_name, model_dir) from None
        raise
    obj: object = module
    for part in class_path.split("."):
        if not hasattr(obj, part):
            classes = [
                n
                for n, c in inspect.getmembers(module, inspect.isclass)
                if c.__module__ == module.__name__
            ]
            raise ConfigError(
                f"entrypoint {entrypoint!r}: {module_name}.py has no {class_path!r}; "
                f"classes defined there: {', '.join(classes) or 'none'}"
            )
        obj = getattr(obj, part)
    if not inspect.isclass(obj) or not hasattr(obj, "train_batch"):
        raise TrialError(
            f"entrypoint {entrypoint!r} is not a PyTorchTrial subclass (it has no train_batch)"
        )
    return obj


def import_failure(entrypoint: str | list[str], err: BaseException, model_dir: Path) -> TrialError:
    """An exception raised while importing the user's entrypoint, as one line naming the
    entrypoint, the error and the user's line: final, as a retry would meet it again."""
    from det_tasks.user_frames import innermost_user_frame

    frame = innermost_user_frame(err, model_dir)
    where = f" ({frame.location})" if frame else ""
    return TrialError(
        f"entrypoint {entrypoint!r} fails to import: {type(err).__name__}: {err}{where}"
    )


def load_trial_class_or_fail(entrypoint: str, model_dir: Path) -> type:
    """``load_trial_class``, with an exception raised by the user's import made final
    (``import_failure``): a trial's worker may be the first to import it, as a deployment's
    flow checks the entrypoint from its source only (``entrypoint_source``)."""
    try:
        return load_trial_class(entrypoint, model_dir)
    except DetTasksError:
        raise
    except Exception as err:
        raise import_failure(entrypoint, err, model_dir) from None


@contextlib.contextmanager
def model_dir_on_path(model_dir: Path) -> Iterator[Path]:
    """Import the user's modules from ``model_dir`` for the block, then forget them, so the
    next run (another model directory) never picks up this one's ``model_def``."""
    root = model_dir.resolve()
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith(str(root) + os.sep):
                del sys.modules[name]


def parse_script_command(entrypoint: str | list[str]) -> tuple[Path, list[str]]:
    """``python3 train.py --epochs 1`` -> (train.py, ["--epochs", "1"]).

    A Determined launch layer in front (``python3 -m determined.launch.torch_distributed
    python3 train.py``) is stripped: the caller starts the workers (``launch_layer``)."""
    from det_tasks.runner.determined_launch_layers import parse_launch_layer

    layer = parse_launch_layer(entrypoint)
    if layer.trial is not None:
        raise ConfigError(
            f"entrypoint {entrypoint!r} launches the trial class {layer.trial!r}, not a script; "
            f"use `entrypoint: {layer.trial}`"
        )
    argv = list(layer.script)
    if len(argv) >= 2 and Path(argv[0]).name.startswith("python") and argv[1].endswith(".py"):
        return Path(argv[1]), argv[2:]
    if argv and argv[0].endswith(".py"):
        return Path(argv[0]), argv[1:]
    raise ConfigError(
        f"entrypoint {entrypoint!r} is neither `module:TrialClass` nor a Python script "
        "command such as `python3 train.py --epochs 1`; other commands are not supported"
    )
