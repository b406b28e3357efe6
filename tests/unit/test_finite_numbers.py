"""NaN and infinity are refused in every numeric input, with one line naming the field
(issue 50, item 8): the config's typed fields, its hyperparameter bounds and constants,
its free-form sections, a job config, and `det job update` / `det experiment set`."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from det_cli import main as det
from det_tasks.config.job import load_job_config
from det_tasks.config.loader import load_config, parse_config
from det_tasks.errors import ConfigError

NON_FINITE = [math.nan, math.inf, -math.inf, "inf", "nan", "-Infinity"]


def _config(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 4},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 2}},
    }
    for dotted, value in overrides.items():
        node = raw
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


def _refusal(raw: dict[str, Any]) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unhonoured-field warnings are not the point
        with pytest.raises(ConfigError) as err:
            parse_config(raw, source="c.yaml")
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(
    "field, path",
    [
        ("resources__weight", "resources.weight"),
        ("resources__priority", "resources.priority"),
        ("resources__max_slots", "resources.max_slots"),
        ("records_per_epoch", "records_per_epoch"),
        ("max_restarts", "max_restarts"),
        ("searcher__max_length__batches", "searcher.max_length.batches"),
        ("min_validation_period__batches", "min_validation_period.batches"),
        ("reproducibility__experiment_seed", "reproducibility.experiment_seed"),
    ],
)
def test_typed_fields_refuse_nan_and_infinity(field: str, path: str, value: Any) -> None:
    message = _refusal(_config(**{field: value}))
    # an int field reads the string "inf" as no integer at all: refused either way
    assert f"`{path}`" in message and ("finite number" in message or "integer" in message)


@pytest.mark.parametrize("value", NON_FINITE)
def test_asha_divisor_refuses_nan_and_infinity(value: Any) -> None:
    raw = _config(searcher__name="adaptive_asha", searcher__max_trials=4)
    raw["searcher"]["divisor"] = value
    message = _refusal(raw)
    assert "`searcher.divisor`" in message and "finite number" in message


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("kind", ["double", "log", "int"])
@pytest.mark.parametrize("bound", ["minval", "maxval"])
def test_hyperparameter_bounds_refuse_nan_and_infinity(kind: str, bound: str, value: Any) -> None:
    leaf: dict[str, Any] = {"type": kind, "minval": -3, "maxval": -1, bound: value}
    message = _refusal(_config(hyperparameters__lr=leaf))
    assert f"`hyperparameters.lr.{bound}`" in message
    assert "finite number" in message or "integer" in message


@pytest.mark.parametrize(
    "leaf, path",
    [
        (math.nan, "hyperparameters.lr"),
        ({"type": "const", "val": math.inf}, "hyperparameters.lr.val"),
        ({"type": "categorical", "vals": [0.1, -math.inf]}, "hyperparameters.lr.vals[1]"),
        ({"nested": {"clip": math.nan}}, "hyperparameters.lr.nested.clip"),
    ],
)
def test_hyperparameter_values_refuse_nan_and_infinity(leaf: Any, path: str) -> None:
    message = _refusal(_config(hyperparameters__lr=leaf))
    assert f"`{path}`" in message and "finite number" in message


def test_free_form_sections_refuse_nan_and_infinity() -> None:
    message = _refusal(_config(data__max_grad_norm=math.inf))
    assert "`data.max_grad_norm` = inf is invalid" in message


def test_yaml_spellings_are_refused_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "const.yaml"
    path.write_text(
        "entrypoint: model_def:Trial\nhyperparameters: {global_batch_size: 4}\n"
        "searcher: {name: single, metric: loss, max_length: {batches: 2}}\n"
        "resources: {weight: .inf}\n"
    )
    with pytest.raises(ConfigError, match=r"const.yaml: `resources.weight` = inf is invalid"):
        load_config(path)


def test_finite_values_still_pass() -> None:
    config = parse_config(
        _config(
            resources__weight=0.5,
            hyperparameters__lr={"type": "log", "minval": -4.0, "maxval": -1.0},
        )
    )
    assert config.resources.weight == 0.5


def test_job_config_refuses_nan_and_infinity(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("entrypoint_script: python3 x.py\nresources: {weight: .nan}\n")
    with pytest.raises(ConfigError, match=r"`resources.weight` = nan is invalid"):
        load_job_config(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["job", "update", "1a2b3c4d", "--weight", "nan"],
        ["job", "update", "1a2b3c4d", "--weight", "inf"],
        ["job", "update", "1a2b3c4d", "--weight=-inf"],
        ["job", "update", "1a2b3c4d", "--priority", "inf"],
        ["experiment", "set", "weight", "1a2b3c4d", "Infinity"],
        ["experiment", "set", "weight", "1a2b3c4d", "NaN"],
        ["experiment", "set", "priority", "1a2b3c4d", "nan"],
    ],
)
def test_cli_refuses_nan_and_infinity_in_one_line(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        det(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "weight" in err[0] or "priority" in err[0]
    assert "number" in err[0]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["experiment", "wait", "1a2b3c4d", "--polling-interval", "nan"], "--polling-interval"),
        (["experiment", "wait", "1a2b3c4d", "--polling-interval", "inf"], "--polling-interval"),
        (["experiment", "wait", "1a2b3c4d", "--polling-interval", "0"], "--polling-interval"),
        (["experiment", "create", "c.yaml", ".", "--max-package-mb", "nan"], "--max-package-mb"),
        (["experiment", "create", "c.yaml", ".", "--max-package-mb=-inf"], "--max-package-mb"),
    ],
)
def test_cli_durations_and_sizes_are_finite_and_positive(
    argv: list[str], option: str, capsys: Any
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        det(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in err and "finite number above 0" in err
