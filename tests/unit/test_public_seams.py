"""What one module uses of another is public: no ``from x import _name`` across modules in
the project's packages (a package may import its own ``_private`` submodules), no
``_private`` module imported from outside the package that holds it, and no
``module._name`` reached through an imported project module."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("det_tasks", "registry", "cluster", "flows", "det_cli", "infra", "bench")


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).parent.parts)


def _is_submodule(module: str, name: str, root: Path) -> bool:
    base = root.joinpath(*module.split("."), name)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_names_crossing(path: Path, root: Path = ROOT) -> list[str]:
    """``module:_name`` for each private name ``path`` imports from another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in PACKAGES or node.module == _module_of(path, root):
            continue
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            if _is_submodule(node.module, name, root) and node.module == _package_of(path, root):
                continue  # a package's own private submodule
            found.append(f"{node.module}:{name}")
    return found


def _found_in_project(check: Callable[[Path], list[str]]) -> dict[str, list[str]]:
    """What ``check`` finds in each of the project's Python files, by file."""
    return {
        str(path.relative_to(ROOT)): names
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (names := check(path))
    }


def test_no_private_name_crosses_modules():
    crossing = _found_in_project(private_names_crossing)
    assert crossing == {}


def test_the_check_sees_a_private_name_but_not_a_packages_own_private_module(tmp_path):
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "_impl.py").write_text("")
    probe = tmp_path / "registry" / "probe.py"
    probe.write_text(
        "from registry.cli import _client\nfrom flows.tasks import train\n"
        "from registry import _impl\nfrom flows import _other\n"
    )
    assert private_names_crossing(probe, tmp_path) == ["registry.cli:_client", "flows:_other"]


def _private_owner(module: str) -> str | None:
    """The package a ``_private`` module of ``module``'s path belongs to, or None."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _project_imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module imported, local name bound to it when it is a module) per project import."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in PACKAGES:
                found.append((node.module, None))
                found += [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, a.asname) for a in node.names if a.name.split(".")[0] in PACKAGES]
    return found


def private_modules_crossing(path: Path, root: Path = ROOT) -> list[str]:
    """Each ``_private`` project module ``path`` imports from outside its package, and each
    ``module._name`` it reaches through an imported project module."""
    tree = ast.parse(path.read_text(), str(path))
    here = _package_of(path, root)
    found = []
    modules: dict[str, str] = {}
    for module, bound in _project_imports(tree):
        parent, _, name = module.rpartition(".")
        is_module = _is_submodule(parent, name, root) if parent else True
        if bound is not None and not is_module:
            continue  # a name imported from a module, not a module
        owner = _private_owner(module)
        if owner is not None and here != owner and not here.startswith(owner + "."):
            found.append(module)
        if bound is not None:
            modules[bound] = module
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_private_module_or_attribute_crosses_packages():
    crossing = _found_in_project(private_modules_crossing)
    assert crossing == {}


def test_the_check_sees_private_modules_and_attributes_across_packages(tmp_path):
    for folder in ("registry", "det_tasks/pytorch"):
        (tmp_path / folder).mkdir(parents=True)
    for module in ("registry/models.py", "det_tasks/pytorch/_trainer.py", "registry/_own.py"):
        (tmp_path / module).write_text("")
    probe = tmp_path / "registry" / "probe.py"
    probe.write_text(
        "from det_tasks.pytorch._trainer import store\nfrom registry import _own, models\n"
        "import registry.models as m\nmodels._parent_run(1)\nm._other\nmodels.public(1)\n"
    )
    assert private_modules_crossing(probe, tmp_path) == [
        "det_tasks.pytorch._trainer",
        "registry.models._other",
        "registry.models._parent_run",
    ]
