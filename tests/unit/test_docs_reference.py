"""The generated reference pages (docs/gen_reference.py, a MkDocs hook) cover the code:
every config field has a note and a row, every `det` and `det-tasks` command has a section,
refused commands and flags are listed with their alternative, and the pages keep their
markers (so `mkdocs build --strict` in `make check` regenerates them from the code)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_gen_reference", ROOT / "docs" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _gen()


def test_every_config_field_has_a_row_and_no_note_is_stale():
    from det_tasks.config import experiment

    text = gen.config_markdown()
    assert sorted(gen.CONFIG_NOTES) == sorted(gen.config_field_paths())
    for field in experiment.ExperimentConfig.model_fields:
        assert f"| `{field}` |" in text
    for field in experiment.SearcherConfig.model_fields:
        assert f"| `{field}` |" in text
    assert '| `nonfinite_loss` | `"warn"` \\| `"error"` \\| `"skip"` | `"warn"` |' in text
    assert "| `max_concurrent_trials` | int (>= 0) | `16` |" in text
    assert "| `entrypoint` | str \\| list of str | **required** |" in text


def test_a_field_without_a_note_fails_the_build(monkeypatch):
    notes = dict(gen.CONFIG_NOTES)
    del notes["searcher.metric"]
    notes["searcher.no_such_field"] = "stale"
    monkeypatch.setattr(gen, "CONFIG_NOTES", notes)
    with pytest.raises(RuntimeError, match=r"searcher\.metric.*searcher\.no_such_field"):
        gen.config_markdown()


def _commands(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, bool]]:
    """(full command, supported) for every subcommand, recursively."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                supported = "instead" not in sub._defaults
                out.append((f"{path} {name}", supported))
                out += _commands(sub, f"{path} {name}")
    return out


@pytest.mark.parametrize("which", ["det", "det-tasks"])
def test_every_command_is_in_the_cli_reference(which):
    parser = gen.det_parser() if which == "det" else gen.det_tasks_parser()
    text = gen.cli_markdown(parser)
    commands = _commands(parser, which)
    assert len(commands) > (40 if which == "det" else 8)
    for command, supported in commands:
        if supported:
            assert f"# `{command}`" in text, command
        else:
            assert f"| `{command}` |" in text, command


def test_refused_flags_and_commands_name_the_alternative():
    text = gen.cli_markdown(gen.det_parser())
    assert "| `--paused` | an experiment starts when it is created" in text
    assert "| `det notebook` | use Jupyter next to the stack" in text
    assert "--hparams" not in gen.cli_markdown(gen.det_tasks_parser())  # internal, suppressed


def test_reference_pages_keep_their_markers_and_the_hook_is_configured():
    import yaml

    pages = {
        "config": "reference/config.md",
        "cli-det": "reference/cli-det.md",
        "cli-det-tasks": "reference/cli-det-tasks.md",
    }
    for name, page in pages.items():
        assert f"<!-- generated: {name} -->" in (ROOT / "docs" / page).read_text()
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert "docs/gen_reference.py" in config["hooks"]
    assert config["strict"] is True
    expanded = gen.on_page_markdown("a\n<!-- generated: cli-det -->\nb")
    assert "`det experiment create`" in expanded and "generated:" not in expanded


def _named_tests() -> list[str]:
    """Every test the reference's "test" column names."""
    return sorted({name for names in gen.FIELD_TESTS.values() for name in names})


@pytest.mark.parametrize("name", _named_tests())
def test_every_test_the_config_reference_names_exists(name):
    path, _, function = name.partition("::")
    source = (ROOT / path).read_text()
    assert not function or f"def {function}(" in source, name


def test_the_config_reference_shows_each_fields_tests():
    text = gen.config_markdown()
    row = next(line for line in text.splitlines() if line.startswith("| `checkpoint_policy` |"))
    assert row.endswith(
        "| `test_bad_input.py::test_typo_in_checkpoint_policy_is_not_silently_accepted`<br>"
        "`test_paths_and_policies.py::test_best_policy_under_a_search_compares_with_the_"
        "experiment_best` |"
    )


def test_tests_named_for_no_field_fail_the_build(monkeypatch):
    stale = dict(gen.FIELD_TESTS, **{"searcher.no_such_field": ["tests/unit/x.py"]})
    monkeypatch.setattr(gen, "FIELD_TESTS", stale)
    with pytest.raises(RuntimeError, match=r"searcher\.no_such_field"):
        gen.config_markdown()


def test_a_plug_in_from_another_package_documents_its_own_fields(monkeypatch):
    """A searcher plug-in installed from outside this project needs no note here: its fields
    are listed with their own descriptions (before, the build raised for the missing note)."""
    from pydantic import BaseModel, Field

    foreign = type(
        "AcmeOptions",
        (BaseModel,),
        {
            "__module__": "acme_search.options",
            "__annotations__": {"temperature": float},
            "temperature": Field(0.5, description="How bold a proposal is"),
        },
    )
    installed = gen._plugin_options()
    monkeypatch.setattr(gen, "_plugin_options", lambda: [*installed, ("acme", foreign)])
    text = gen.config_markdown()
    assert "### searcher: acme (plug-in)" in text
    assert "| `temperature` | float | `0.5` | How bold a proposal is (from `acme_search`) |" in text
    assert "searcher.temperature" not in gen.config_field_paths()
