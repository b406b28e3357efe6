"""The generated package reference (docs/reference/packages.md, filled by
docs/gen_reference.py while the site builds) lists every module and the contracts as
pyproject.toml has them, and the hand-written pages that name the packages and layers
(the README, docs/concepts/architecture.md) agree with pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.unit.test_docs_reference import gen

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINTER = PYPROJECT["tool"]["importlinter"]
LAYERS = next(c for c in LINTER["contracts"] if c["type"] == "layers")["layers"]


def test_the_page_keeps_its_markers_and_is_in_the_nav():
    page = (ROOT / "docs" / "reference" / "packages.md").read_text()
    for name in ("layers", "dynamic-imports", "packages"):
        assert f"<!-- generated: {name} -->" in page
    assert "reference/packages.md" in (ROOT / "mkdocs.yml").read_text()


def test_every_module_of_every_package_is_listed_with_its_summary():
    text = gen.packages_markdown()
    assert gen.project_packages() == LINTER["root_packages"]
    for package in LINTER["root_packages"]:
        assert f"### `{package}/`" in text
        for path in (ROOT / package).rglob("*.py"):
            if not (path.parent / "__init__.py").is_file() or path.name == "__init__.py":
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            assert f"| `{module}` |" in text, f"{module} is not listed"
    assert "| `det_tasks.config.lengths` | A config length" in text


def test_a_summary_is_the_first_sentence_unwrapped():
    doc = "Where checkpoint bytes go: the\n``CheckpointStore``. More here.\n\nDetails."
    assert gen.summary_line(doc) == "Where checkpoint bytes go: the ``CheckpointStore``."
    assert gen.summary_line("No full stop") == "No full stop"


def test_a_module_without_a_docstring_fails_the_build(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "inner").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text('"""The package."""\n')
    (tmp_path / "pkg" / "inner" / "__init__.py").write_text('"""Inner."""\n')
    (tmp_path / "pkg" / "inner" / "bare.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "data").mkdir()
    (tmp_path / "pkg" / "data" / "model_def.py").write_text("X = 1\n")  # not a package
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    with pytest.raises(RuntimeError, match=r"pkg/inner/bare\.py has no docstring"):
        list(gen.package_modules("pkg"))
    (tmp_path / "pkg" / "inner" / "bare.py").write_text('"""Now it says why."""\n')
    assert [m for m, _ in gen.package_modules("pkg")] == ["pkg", "pkg.inner", "pkg.inner.bare"]


def test_the_layers_and_contracts_are_pyprojects():
    text = gen.layers_markdown()
    numbered = re.findall(r"^\d+\. (.+?)(?: \(side by side.*)?$", text, re.MULTILINE)
    assert [item.replace("`", "") for item in numbered] == [
        " | ".join(p.strip() for p in layer.split("|"))
        for contract in LINTER["contracts"]
        if contract["type"] == "layers"
        for layer in contract["layers"]
    ]
    for contract in LINTER["contracts"]:
        assert contract["name"] in text
        for exception in contract.get("ignore_imports", []):
            assert f"`{exception}`" in text


def test_every_declared_dynamic_import_is_listed_with_its_entries():
    text = gen.dynamic_imports_markdown()
    declared = PYPROJECT["tool"]["det_tasks"]["dynamic_imports"]
    for group in declared["groups"]:
        assert f"| `{group}` |" in text
        for name, target in PYPROJECT["project"]["entry-points"].get(group, {}).items():
            assert f"`{name} = {target}`" in text
    for module in declared["by_name"]:
        assert f"`{module}`" in text


def _layers_in(text: str) -> list[str]:
    """The backticked package names of a sentence, in order."""
    return re.findall(r"`([a-z_]+)`", text)


def test_the_readme_and_architecture_name_pyprojects_packages_and_layers():
    packages = LINTER["root_packages"]
    readme = (ROOT / "README.md").read_text()
    said = re.search(
        r"The (\w+) packages sit in import layers,\s+top first: (.+?) \(", readme, re.S
    )
    assert said is not None, "README: the sentence naming the layers is gone"
    assert said.group(1) == {7: "seven", 8: "eight"}.get(len(packages), str(len(packages)))
    flat = [p.strip() for layer in LAYERS for p in layer.split("|")]
    assert _layers_in(said.group(2)) == flat
    layout = readme.split("## Layout", 1)[1]
    for package in packages:
        assert f"`{package}/`" in layout, f"README's Layout does not name {package}/"
    architecture = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    assert "seven Python packages" in architecture and len(packages) == 7
    table = [
        row.split("|")[1].strip() for row in architecture.splitlines() if row.startswith("| `")
    ]
    assert [name.strip("`/") for name in table] == flat
