"""What a trial is, as the flow sends it to a worker: ``TrialSpec``, with the config it
entered (det_tasks.config.entered), and whether its trials can be held in one process.

Light on purpose: the experiment flow builds specs and imports no torch; the worker's
``det_tasks.runner.held`` builds the trial from one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from det_tasks.config import ExperimentConfig
from det_tasks.config.entered import EnteredConfig, enter_file

__all__ = ["TrialSpec", "entered_config", "holdable", "trial_config"]


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    """Everything needed to build one trial anywhere (it is sent to workers, so it holds
    paths, plain values and the entered config, never a model)."""

    config_path: str
    model_dir: str
    overrides: tuple[str, ...]
    trial_id: int
    hparams: dict[str, Any]
    experiment_run_key: str | None = None
    device: str | None = None
    # The config as it entered (the flow validated it once, overrides applied): a worker
    # builds the trial from it and never reads the file or validates again. None: this
    # process enters config_path with the spec's overrides (a spec built by hand).
    config: EnteredConfig | None = None

    @property
    def key(self) -> str:
        """Names the trial across workers: experiment run and trial id."""
        return f"{self.experiment_run_key or 'local'}/trial-{self.trial_id}"


def entered_config(spec: TrialSpec) -> EnteredConfig:
    """The trial's config: the one the flow sent (no file read, no validation), or without
    one the file with the spec's overrides, entered here."""
    if spec.config is not None:
        return spec.config
    return enter_file(Path(spec.config_path), list(spec.overrides))


def trial_config(spec: TrialSpec) -> tuple[dict[str, Any], ExperimentConfig]:
    """The trial's raw config and its validated form (``entered_config``)."""
    entered = entered_config(spec)
    return entered.raw, entered.config


def holdable(config: ExperimentConfig) -> str | None:
    """None if the experiment's trials can be held in one process; else why not (script
    entrypoints and multi-process trials train whole segments in their own processes)."""
    if not config.is_trial_class_entrypoint:
        return (
            "its entrypoint is a script (Trainer API or Core API), which runs a whole segment "
            "at once in its own process"
        )
    if config.resources.slots_per_trial > 1:
        return (
            f"resources.slots_per_trial={config.resources.slots_per_trial} needs a process per "
            "slot (torchrun/horovodrun)"
        )
    return None
