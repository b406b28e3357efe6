"""Imports import-linter cannot see are declared beside its contracts, in pyproject.toml's
``[tool.det_tasks.dynamic_imports]``: every entry-point group with the modules that load it
and the packages its entries may name, and every module that imports code by name. A new
group, a loader elsewhere, an entry naming another package or a new ``import_module`` fails
here until it is declared (and so reviewed as a seam between layers)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("det_tasks", "registry", "cluster", "flows", "det_cli", "infra", "bench")
LOADERS = {"load_one", "load_all"}
BY_NAME = {"import_module", "__import__"}


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _declared() -> dict[str, Any]:
    return _pyproject()["tool"]["det_tasks"]["dynamic_imports"]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _group_of(arg: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return constants.get(arg.id) if isinstance(arg, ast.Name) else None


def dynamic_loads() -> tuple[dict[str, set[str]], set[str]]:
    """(entry-point group -> modules that load it, modules that import by name)."""
    groups: dict[str, set[str]] = {}
    by_name: set[str] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            constants = {
                t.id: n.value.value
                for n in tree.body
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                for t in n.targets
                if isinstance(t, ast.Name) and isinstance(n.value.value, str)
            }
            module = _module_of(path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                name = _called(node)
                if name in BY_NAME:
                    by_name.add(module)
                elif name in LOADERS and module != "det_tasks.plugins":
                    group = _group_of(node.args[0], constants) or f"<unresolved in {module}>"
                    groups.setdefault(group, set()).add(module)
    return groups, by_name


def test_every_entry_point_group_is_declared_and_names_only_its_packages() -> None:
    declared = _declared()["groups"]
    ours = {
        g: e
        for g, e in _pyproject()["project"]["entry-points"].items()
        if g.startswith("det_tasks.")
    }
    assert sorted(ours) == sorted(declared)
    for group, entries in ours.items():
        for name, target in entries.items():
            module = target.split(":")[0]
            allowed = declared[group]["may_name"]
            assert any(module == p or module.startswith(p + ".") for p in allowed), (
                f"{group} entry {name} = {target} names a package outside {allowed}"
            )


def test_every_dynamic_load_in_the_code_is_declared() -> None:
    groups, by_name = dynamic_loads()
    declared = _declared()
    assert {g: sorted(m) for g, m in groups.items()} == {
        g: sorted(d["loaded_by"]) for g, d in declared["groups"].items()
    }
    assert sorted(by_name) == sorted(declared["by_name"])
