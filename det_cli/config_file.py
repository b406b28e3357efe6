"""An experiment config read and validated with its overrides, as the flow will read it:
``det_tasks.runner.trial_setup.load_raw_config``'s reading, without importing torch with
the PyTorch API (1.7 s of CPU a ``det experiment create`` or ``continue``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_config", "load_config_text"]


def load_config(path: Path, overrides: list[str]) -> tuple[dict[str, Any], Any]:
    """The raw mapping with ``overrides`` applied, and its ExperimentConfig."""
    from det_tasks.config import apply_overrides
    from det_tasks.config.loader import parse_with_overrides, read_config_file

    raw = read_config_file(path)
    config = parse_with_overrides(raw, overrides, str(path))
    return (apply_overrides(raw, overrides) if overrides else raw), config


def load_config_text(path: Path, overrides: list[str]) -> tuple[str, dict[str, Any], Any]:
    """The file's text (what a submission sends), read once, and ``load_config``'s pair
    parsed from it (det_tasks.config.entered: the one entry)."""
    from det_tasks.config.entered import enter_text
    from det_tasks.config.loader import read_config_text

    text = read_config_text(path)
    entered = enter_text(text, str(path), overrides)
    return text, entered.raw, entered.config
