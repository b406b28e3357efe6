"""What one module uses of another is public: no ``from x import _name`` across modules in
the project's packages (a package may import its own ``_private`` submodules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("det_tasks", "registry", "cluster", "searchers", "flows", "det_cli", "infra")


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


def test_no_private_name_crosses_modules():
    crossing = {
        str(path.relative_to(ROOT)): names
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (names := private_names_crossing(path))
    }
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
