"""Which trial class (and with which config and hparams) a checkpoint was written by, for
every layout Determined used: ``load_data.json`` with ``trial_cls_spec`` (0.15+), with only
the experiment config (older), or no ``load_data.json`` at all, where the class comes from
the ``entrypoint`` of the experiment config kept in ``code/``. Reading these runs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from det_tasks.checkpoints import format as ckpt
from det_tasks.errors import CheckpointError

__all__ = ["code_config", "read_load_data", "trial_class_spec"]


def read_load_data(directory: Path) -> dict[str, Any]:
    """``load_data.json``, completed from ``code/`` where the checkpoint predates it: the
    experiment config and const hyperparameters of the one config there naming a class."""
    path = directory / ckpt.LOAD_DATA_FILE
    data: dict[str, Any] = {}
    if path.exists():
        raw = ckpt.read_json(path)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{str(path)!r} does not hold a JSON object")
        data = dict(raw)
    meta_path = directory / ckpt.METADATA_FILE
    meta = ckpt.read_json(meta_path) if meta_path.exists() else {}
    if isinstance(meta, dict):  # Checkpoint.download() of <= 0.17.7 wrote these here
        for key in ("experiment_config", "hparams"):
            if not data.get(key) and isinstance(meta.get(key), dict):
                data[key] = meta[key]
    if not data.get("experiment_config"):
        config = code_config(directory)
        if config is not None:
            data["experiment_config"] = config
            data.setdefault("hparams", _const_hparams(config.get("hyperparameters") or {}))
    return data


def trial_class_spec(directory: Path, load_data: dict[str, Any]) -> str:
    """``module:Class``: the recorded ``trial_cls_spec``, else the experiment config's
    trial-class entrypoint."""
    spec = load_data.get("trial_cls_spec")
    if isinstance(spec, str) and ":" in spec:
        return spec
    config = load_data.get("experiment_config") or {}
    entrypoint = config.get("entrypoint") if isinstance(config, dict) else None
    if isinstance(entrypoint, str) and _is_class_entrypoint(entrypoint):
        return entrypoint.strip()
    raise CheckpointError(
        f"checkpoint {str(directory)!r} does not record its trial class: load_data.json has "
        "no trial_cls_spec, and no experiment config (in load_data.json or a YAML file under "
        "code/) has an entrypoint of the form module:TrialClass; pass trial_class=YourTrial"
    )


def code_config(directory: Path) -> dict[str, Any] | None:
    """The experiment config under ``code/`` whose entrypoint names a trial class; None if
    there is none. Several naming different classes are ambiguous: an error."""
    code = directory / ckpt.CODE_DIR
    if not code.is_dir():
        return None
    found: dict[str, dict[str, Any]] = {}
    for file in sorted([*code.glob("*.yaml"), *code.glob("*.yml")]):
        try:
            config = yaml.safe_load(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # not an experiment config
        entrypoint = config.get("entrypoint") if isinstance(config, dict) else None
        if isinstance(entrypoint, str) and _is_class_entrypoint(entrypoint):
            found.setdefault(entrypoint.strip(), config)
    if len(found) > 1:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} records no trial class and the configs in its "
            f"code/ name several ({', '.join(sorted(found))}); pass trial_class=YourTrial"
        )
    return next(iter(found.values()), None)


def _is_class_entrypoint(entrypoint: str) -> bool:
    text = entrypoint.strip()
    return " " not in text and ":" in text


def _const_hparams(space: dict[str, Any]) -> dict[str, Any]:
    """The values of a config's const hyperparameters (raw values or ``{type: const}``);
    searched ones are unknown here, so the caller passes them with hparams=."""
    out: dict[str, Any] = {}
    for name, value in space.items():
        if isinstance(value, dict) and value.get("type") == "const":
            out[name] = value.get("val")
        elif isinstance(value, dict) and "type" not in value:
            out[name] = _const_hparams(value)
        elif not isinstance(value, dict):
            out[name] = value
    return out
