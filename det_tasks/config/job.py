"""A batch job's config (``det job run batch_inference.yaml .`` in the Trainer-API document).

Either a script (``entrypoint_script: python3 batch_inference.py``) that reads
``context.config_data``, or no script and a ``data:`` section naming a registered model
(``model_uri``) for the platform's sharded batch inference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from det_tasks.config.loader import (
    describe_validation_error,
    parse_yaml_text,
    refuse_non_finite,
)
from det_tasks.errors import ConfigError

__all__ = ["BATCH_INFERENCE_DATA_KEYS", "JobConfig", "load_job_config"]

# The data keys the built-in batch inference takes, as the flow's parameters.
BATCH_INFERENCE_DATA_KEYS = (
    "model_uri",
    "dataset",
    "num_shards",
    "batch_size",
    "output",
    "columns",
    "id_column",
    "workers",
)


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str | None = None
    description: str | None = None
    entrypoint_script: str | None = None
    entrypoint: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    resources: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    max_restarts: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _runnable(self) -> JobConfig:
        if self.entrypoint_script and self.entrypoint:
            raise ValueError("give entrypoint_script or entrypoint, not both")
        if not self.script and "model_uri" not in self.data:
            raise ValueError(
                "nothing to run: set `entrypoint_script: python3 batch_inference.py`, or "
                "`data.model_uri` (e.g. models:/mnist@champion) for the built-in batch inference"
            )
        if not self.script:
            unknown = sorted(set(self.data) - set(BATCH_INFERENCE_DATA_KEYS))
            if unknown:
                raise ValueError(
                    f"`data` has {unknown}, which the built-in batch inference does not take: "
                    f"use {list(BATCH_INFERENCE_DATA_KEYS)}, or an entrypoint_script that reads "
                    "context.config_data"
                )
        return self

    @property
    def script(self) -> str | None:
        return self.entrypoint_script or self.entrypoint


def load_job_config(path: str | Path) -> tuple[dict[str, Any], JobConfig]:
    """The raw mapping and its validated form; errors name the file and the field."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {source!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {source!r} cannot be read: {err}") from None
    raw = parse_yaml_text(text, source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a job config must be a mapping")
    refuse_non_finite(raw, source)
    try:
        return raw, JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, raw, source)) from None
