"""An experiment's entrypoint checked from its source, without importing the user's code.

A deployment's flow process never runs the trial: importing the user's module there only to
check it brought in torch and the module's own imports (~2 s before the first trial could
start). This reads the entrypoint's file instead and refuses what is certain to fail, in the
words ``load_trial_class`` uses: no such module, a syntax error in it, no such name defined
there, a class with no base class and no ``train_batch``, a script that is not there. What
only an import can tell (an error raised while importing, a base class that is not a trial)
the trial's worker reports, as a final error (no retries): ``entrypoint.import_failure``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from det_tasks.config import ExperimentConfig
from det_tasks.errors import ConfigError, TrialError
from det_tasks.runner.determined_launch_layers import parse_launch_layer
from det_tasks.runner.entrypoint import (
    no_module_error,
    parse_script_command,
    split_trial_entrypoint,
    syntax_error,
)

__all__ = ["check_entrypoint_source"]


def check_entrypoint_source(config: ExperimentConfig, model_dir: Path) -> None:
    """Refuse an entrypoint that cannot load, reading its source only (ConfigError or
    TrialError, as ``check_entrypoint`` says them); an entrypoint only an import can judge
    passes."""
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    entrypoint = config.entrypoint
    if config.is_trial_class_entrypoint:
        assert isinstance(entrypoint, str)
        _check_trial_class(entrypoint, model_dir)
        return
    launched_trial = parse_launch_layer(entrypoint).trial
    if launched_trial is not None:
        _check_trial_class(launched_trial, model_dir)
        return
    script, _ = parse_script_command(entrypoint)
    if not (model_dir / script).resolve().is_file():
        raise ConfigError(f"entrypoint script {str(script)!r} not found in {str(model_dir)!r}")


def _check_trial_class(entrypoint: str, model_dir: Path) -> None:
    module_name, class_path = split_trial_entrypoint(entrypoint)
    model_dir = model_dir.resolve()
    source = _module_source(module_name, model_dir)
    if source is None:
        if _found_elsewhere(module_name, model_dir):
            return  # installed, or not plain source: the worker's import judges it
        raise no_module_error(entrypoint, module_name, model_dir)
    text = importlib.util.decode_source(source.read_bytes())
    try:
        tree = ast.parse(text, filename=str(source))
    except SyntaxError as err:
        raise syntax_error(entrypoint, err) from None
    _check_defined(entrypoint, module_name, class_path.split(".")[0], tree)


def _module_source(module_name: str, model_dir: Path) -> Path | None:
    """The module's ``.py`` file (or package ``__init__.py``) in ``model_dir``, if any."""
    base = model_dir.joinpath(*module_name.split("."))
    for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _found_elsewhere(module_name: str, model_dir: Path) -> bool:
    """Whether the module's top-level name exists other than as source in ``model_dir``
    (a folder, an extension module, or installed): found without running any of it."""
    top = module_name.split(".")[0]
    if (model_dir / top).exists() or any(model_dir.glob(f"{top}.*")):
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return True  # cannot tell: let the worker's import say


def _check_defined(entrypoint: str, module_name: str, name: str, tree: ast.Module) -> None:
    """The name is bound at the module's top level; a class is a trial where that is
    certain from its source alone."""
    bound, classes, unknown = _top_level_names(tree)
    if unknown:
        return  # `from x import *` or a module __getattr__: only an import can tell
    if name not in bound:
        file = module_name.split(".")[-1]
        listed = ", ".join(sorted({c.name for c in classes})) or "none"
        raise ConfigError(
            f"entrypoint {entrypoint!r}: {file}.py has no {name!r}; classes defined there: {listed}"
        )
    same = [c for c in classes if c.name == name]
    patched = any(  # `Plain.train_batch = ...` somewhere: only the import can tell
        isinstance(n, ast.Attribute) and n.attr == "train_batch" and isinstance(n.ctx, ast.Store)
        for n in ast.walk(tree)
    )
    if bound[name] == 1 and len(same) == 1 and not patched and _surely_not_a_trial(same[0]):
        raise TrialError(
            f"entrypoint {entrypoint!r} is not a PyTorchTrial subclass (it has no train_batch)"
        )


def _top_level_names(tree: ast.Module) -> tuple[dict[str, int], list[ast.ClassDef], bool]:
    """Names the module binds outside functions and classes (with how often), its classes,
    and whether a star import or a module ``__getattr__`` makes the list uncertain."""
    bound: dict[str, int] = {}
    classes: list[ast.ClassDef] = []
    unknown = False
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            unknown |= node.name == "__getattr__"
            if isinstance(node, ast.ClassDef):
                classes.append(node)
            pending.extend(node.decorator_list)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                unknown |= alias.name == "*"
                names.append(alias.asname or alias.name.split(".")[0])
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.append(node.id)
            pending.extend(ast.iter_child_nodes(node))
        for bound_name in names:
            bound[bound_name] = bound.get(bound_name, 0) + 1
    return bound, classes, unknown


def _surely_not_a_trial(cls: ast.ClassDef) -> bool:
    """A class with no base class, metaclass or decorator that defines no train_batch."""
    if cls.bases or cls.keywords or cls.decorator_list:
        return False
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "train_batch":
                return False
        elif any(isinstance(n, ast.Name) and n.id == "train_batch" for n in ast.walk(node)):
            return False
    return True
