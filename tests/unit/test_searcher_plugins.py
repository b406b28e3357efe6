"""A searcher added from outside the package, by name: a distribution on the path registers a
SearcherPlugin under the det_tasks.searchers entry points, and ``searcher.name`` runs it, with
its own fields checked as strictly as the config's own (one-line errors naming the field).
Optuna is such a plug-in; reading its config does not import Optuna."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from det_tasks.config import parse_config
from det_tasks.errors import ConfigError
from det_tasks.plugins import _entries
from det_tasks.searchers.base import Work
from det_tasks.searchers.choose import make_searcher

PLUGIN_MODULE = """
from pydantic import Field

from det_tasks.searchers.base import Searcher
from det_tasks.config.searcher_plugins import SearcherOptions, SearcherPlugin


class SweepOptions(SearcherOptions):
    points: int = Field(ge=1)
    start: float = 0.0
    step: float = 1.0


def check(searcher):
    if searcher.max_length is None:
        raise ValueError("the sweep searcher needs max_length, e.g. max_length: {batches: 8}")


def make(config, max_batches):
    options = SweepOptions.model_validate(config.searcher.plugin_fields)
    trials = [
        {"global_batch_size": 8, "x": options.start + i * options.step}
        for i in range(options.points)
    ]
    return Searcher(trials, max_batches)


PLUGIN = SearcherPlugin(make=make, options=SweepOptions, check=check)
"""


@pytest.fixture
def sweep_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``sweep`` searcher, installed as a third party's distribution would be."""
    (tmp_path / "sweep_searcher.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    dist = tmp_path / "sweep_searcher-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sweep-searcher\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[det_tasks.searchers]\nsweep = sweep_searcher:PLUGIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _entries.cache_clear()
    yield
    _entries.cache_clear()


def _config(**searcher: Any) -> dict[str, Any]:
    return {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 8, "x": 0.0},
        "searcher": {"metric": "loss", "max_length": {"batches": 8}, **searcher},
    }


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        make_searcher(parse_config(raw))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.usefixtures("sweep_plugin")
def test_a_plugin_searcher_runs_by_name_with_its_own_fields() -> None:
    config = parse_config(_config(name="sweep", points=3, start=0.5, step=0.25))
    assert config.searcher.plugin_fields == {"points": 3, "start": 0.5, "step": 0.25}
    assert make_searcher(config, 8).start() == [
        Work(1, {"global_batch_size": 8, "x": 0.5}, 8),
        Work(2, {"global_batch_size": 8, "x": 0.75}, 8),
        Work(3, {"global_batch_size": 8, "x": 1.0}, 8),
    ]


@pytest.mark.usefixtures("sweep_plugin")
def test_a_plugins_fields_get_the_configs_one_line_errors() -> None:
    assert _error(_config(name="sweep", points=0)) == (
        "config: `searcher.points` = 0 is invalid: Input should be greater than or equal to 1"
    )
    assert _error(_config(name="sweep", points=2, setp=0.5)) == (
        "config: unknown field `searcher.setp`; did you mean `step`?"
    )
    assert _error(_config(name="sweep")) == "config: required field `searcher.points` is missing"
    assert _error(_config(name="grid", points=2)) == (
        "config: `searcher.points` is for name: sweep only; remove it or use name: sweep"
    )
    raw = _config(name="sweep", points=2)
    del raw["searcher"]["max_length"]
    assert "the sweep searcher needs max_length" in _error(raw)


@pytest.mark.usefixtures("sweep_plugin")
def test_an_unknown_searcher_name_lists_the_built_in_and_installed_ones() -> None:
    assert _error(_config(name="swep", points=2)) == (
        "config: `searcher.name` = 'swep' is invalid: no searcher is named 'swep'; did you "
        "mean 'sweep'? built in: single, grid, random, adaptive_asha; installed plug-ins: "
        "optuna, sweep (a package adds one as a det_tasks.searchers entry point)"
    )


def test_reading_an_optuna_config_does_not_import_optuna() -> None:
    code = textwrap.dedent(
        """
        import sys
        from det_tasks.config import parse_config
        config = parse_config({
            "entrypoint": "model_def:Trial",
            "hyperparameters": {"global_batch_size": 8, "x": {"type": "double", "minval": 0,
                                                             "maxval": 1}},
            "searcher": {"name": "optuna", "metric": "loss", "max_trials": 4,
                         "max_length": {"batches": 8}, "sampler": "gp"},
        })
        print(config.searcher.plugin_fields, "optuna" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "{'sampler': 'gp'} False"
