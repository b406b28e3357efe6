"""The docs' commands, as users copy them (every `sh` block under docs/, and the README).

The quickstart's embedded part runs for real: `det-tasks run examples/mnist/const.yaml --test`
and the Python snippet that loads its checkpoint back. Every other command line is checked
against the real thing it names: `det` and `det-tasks` lines parse with the real parsers to a
supported command, `make` targets exist in the Makefile, `python -m` modules exist,
deployments exist in prefect.yaml (by their flow's name), and the files named are there.
(The stack lines run for real in
tests/integration/test_submit.py::test_det_runs_the_mnist_tutorial_verbatim.)"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.DOTALL | re.MULTILINE)


def _command_lines(path: Path) -> list[list[str]]:
    """Each shell line as argv lists, split on && and with comments removed."""
    out = []
    for block in _blocks(path, "sh"):
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
            lexer.whitespace_split = True
            argv: list[str] = []
            for token in [*lexer, ";"]:
                if token in (";", "&&"):
                    out += [argv] if argv else []
                    argv = []
                else:
                    argv.append(token)
    return out


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.MULTILINE))


def _deployments() -> set[str]:
    """`flow-name/deployment-name` for each deployment, the flow's name read from the flow."""
    doc = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    out = set()
    for deployment in doc["deployments"]:
        module, _, attr = deployment["entrypoint"].replace(":", ".").rpartition(".")
        flow = getattr(importlib.import_module(module), attr)
        out.add(f"{flow.name}/{deployment['name']}")
    return out


def _check(argv: list[str], cwd: Path) -> Path:
    """Assert one command line names real things; returns the directory after it."""
    from det_cli.dispatch import build_parser
    from det_cli.unsupported import _refuse
    from det_tasks.runner.cli import _parser

    program, args = argv[0], argv[1:]
    if program == "cd":
        target = (cwd / args[0]).resolve()
        assert target.is_dir(), argv
        return target
    if program in ("source", "."):
        assert args[0] in (".stack/env", ".venv/bin/activate"), argv  # made by make up/install
    elif program == "make":
        assert set(args) <= _make_targets(), argv
    elif program == "det":
        parsed = build_parser().parse_args(args)
        assert parsed.func is not _refuse, argv
    elif program == "det-tasks":
        _parser().parse_args(args)
    elif program == "python" and args[:1] == ["-m"]:
        assert importlib.util.find_spec(args[1]) is not None, argv
    elif program == "python" and args[:1] == ["-c"]:
        compile(args[1], "<quickstart>", "exec")
    elif program == "prefect":
        assert args[:2] == ["deployment", "run"] and args[2] in _deployments(), argv
    else:
        raise AssertionError(f"the quickstart runs {program!r}, which this test does not know")
    for arg in args:
        if arg.endswith((".yaml", ".yml")):
            assert (cwd / arg).is_file(), (argv, cwd)
    return cwd


PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if _blocks(p, "sh"))


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.stem)
def test_every_command_on_the_page_names_real_things(page):
    lines = _command_lines(page)
    if page in (QUICKSTART, ROOT / "README.md"):
        assert any(a[:3] == ["det", "experiment", "create"] for a in lines), lines
    cwd = ROOT
    for argv in lines:
        cwd = _check(argv, cwd)


def test_the_embedded_quickstart_trains_and_loads_its_checkpoint_back(
    tmp_path, monkeypatch, capsys
):
    from det_tasks.runner.cli import main

    command = next(a for a in _command_lines(QUICKSTART) if a[:2] == ["det-tasks", "run"])
    assert command == ["det-tasks", "run", "examples/mnist/const.yaml", "--test"]
    for name in ("MLFLOW_TRACKING_URI", "DET_TASKS_DASK_SCHEDULER", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "home"))
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the command's relative path
    monkeypatch.chdir(tmp_path)
    assert main(command[1:]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.find("{") :])
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.parent == tmp_path / "checkpoints" and checkpoint.is_dir()

    snippet = _blocks(QUICKSTART, "python")[0].replace("<uuid>", checkpoint.name)
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "quickstart.md", "exec"), namespace)
    trial = namespace["trial"]
    assert type(trial).__name__ == "MNistTrial"
    assert sum(p.numel() for p in trial.model.parameters()) > 0
