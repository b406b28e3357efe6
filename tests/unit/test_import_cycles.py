"""No import cycle among det_tasks modules.

Every ``import``/``from ... import`` statement counts, at module level or inside a function
(a deferred import still closes a circle at run time), except under ``if TYPE_CHECKING:``
(never executed). An edge goes to the module named, or to ``pkg.name`` when the imported
name is itself a det_tasks module; a package's ``__init__`` is the package's node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import det_tasks

ROOT = Path(det_tasks.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_the_cycle_finder_finds_a_deferred_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_edges(tmp_path):
    tree = ast.parse(
        "import os\n"
        "def f():\n    from det_tasks import compat\n"
        "if TYPE_CHECKING:\n    from det_tasks.sinks import MetricsSink\n"
    )
    names = [getattr(n, "module", None) for n in _imports(tree)]
    assert names == [None, "det_tasks"]


def test_det_tasks_has_no_import_cycle():
    graph = import_graph()
    assert "det_tasks.pytorch._load" in graph and "det_tasks.compat" in graph
    cycles = find_cycles(graph)
    assert cycles == [], "import cycles among det_tasks modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_compat_is_a_leaf_of_the_pytorch_package():
    graph = import_graph()
    importers = sorted(
        name
        for name, targets in graph.items()
        if name.startswith("det_tasks.pytorch")
        and any(t.startswith("det_tasks.compat") for t in targets)
    )
    assert importers == []
