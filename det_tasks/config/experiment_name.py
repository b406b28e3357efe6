"""An experiment's name, decided once where its config enters (``det experiment create``,
the experiment flow, ``det-tasks run``) and carried from there with the config, as a
``name=...`` override, to every worker.

A config without ``name:`` is named after its file (``const.yaml``: ``const``). Deriving it
again on a worker named it after whatever file the worker wrote the config to (a submitted
experiment's became ``config-ddd979602d7b``): two MLflow experiments, each with a run left
RUNNING. The override travels wherever the overrides do (a held trial's raw config, a
``det-tasks run`` segment's ``--param``), so no worker derives a name from a file again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.loader import apply_overrides, parse_config, parse_yaml_text
from det_tasks.config.names import experiment_name_problem
from det_tasks.errors import ConfigError

__all__ = ["experiment_name", "name_override", "named", "submitted_name"]


def experiment_name(config_name: str | None, config_path: str | Path) -> str:
    """The config's ``name``, else its file's stem (Determined's configs often have none)."""
    return config_name or Path(config_path).stem


def name_override(name: str) -> str:
    """``name="..."``: the override that names the experiment (quoted as JSON, which YAML
    reads back as the same string: a stem such as ``2024`` or ``true`` stays text)."""
    return f"name={json.dumps(name)}"


def named(
    raw: dict[str, Any], config: ExperimentConfig, config_path: str | Path, overrides: list[str]
) -> tuple[dict[str, Any], ExperimentConfig, list[str]]:
    """The raw config, its validated form and the overrides, with the experiment's name
    decided: unchanged when the config has one, else named after ``config_path`` with an
    override that carries the name to every worker."""
    if config.name:
        return raw, config, overrides
    name = experiment_name(None, config_path)
    overrides = [*overrides, name_override(name)]
    raw = apply_overrides(raw, [name_override(name)])
    if experiment_name_problem(name) is not None:  # refused in the loader's words
        return raw, parse_config(raw, source=str(config_path)), overrides
    # Only the name changes, and it is checked above: the validated config is not built again.
    return raw, config.model_copy(update={"name": name}), overrides


def submitted_name(config: str, config_yaml: str | None, overrides: Sequence[str]) -> str:
    """The name of a submitted experiment from what was submitted (the config's file name,
    its text, the overrides), before any of it ran: its ``name`` as overridden, else the
    config's own, else the file's stem."""
    try:
        raw = parse_yaml_text(config_yaml, config) if config_yaml else {}
        raw = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides))
    except ConfigError:  # the flow refuses it and says why; the listing shows the file
        raw = {}
    name = raw.get("name")
    return name if isinstance(name, str) and name else experiment_name(None, config)
