"""No function over 60 lines outside the tests (docstring included): a longer one is split
by concept, as the house style asks (docs/concepts/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("det_tasks", "registry", "cluster", "searchers", "flows", "det_cli", "infra", "bench")
MAX_LINES = 60


def long_functions(path: Path) -> list[str]:
    """``name (N lines)`` for each function or method in ``path`` over MAX_LINES."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


def test_no_function_is_over_sixty_lines():
    found = {
        str(path.relative_to(ROOT)): names
        for folder in CHECKED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (names := long_functions(path))
    }
    assert found == {}


def test_the_check_counts_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    probe = tmp_path / "probe.py"
    short = "    def short(self):\n        pass\n"
    probe.write_text(f"class A:\n    def long(self):\n{body}\n\n{short}")
    assert long_functions(probe) == [f"long ({MAX_LINES + 1} lines)"]
