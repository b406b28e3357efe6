"""The typed experiment config: Determined's YAML fields, validated once at the boundary.

Every model forbids unknown keys, so a typo fails before training with the field's path;
``det_tasks.config.loader`` turns pydantic's errors into messages that name the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    field_validator,
    model_validator,
)

from det_tasks.checkpoints.backends import StorageOptions, parse_storage

# The built-in storage types' models, still importable from here (det_tasks.config's names).
from det_tasks.checkpoints.backends.directory import DirectoryStorage
from det_tasks.checkpoints.backends.s3 import S3Storage
from det_tasks.checkpoints.backends.shared_fs import SharedFSStorage
from det_tasks.config.grid import grid_problem
from det_tasks.config.hyperparameters import ConstHP, parse_hyperparameters
from det_tasks.config.names import experiment_name_problem
from det_tasks.config.searcher_plugins import (
    BUILT_IN_SEARCHERS,
    find_searcher_plugin,
    plugin_owning,
)
from det_tasks.errors import ConfigError

__all__ = [
    "CheckpointStorageConfig",
    "DirectoryStorage",
    "ExperimentConfig",
    "Length",
    "OptimizationsConfig",
    "ProfilingConfig",
    "ReproducibilityConfig",
    "SlurmConfig",
    "ResourcesConfig",
    "S3Storage",
    "SearcherConfig",
    "SharedFSStorage",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Length(_Strict):
    """A training length in one unit: ``{batches: N}``, ``{epochs: N}`` or ``{records: N}``."""

    batches: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)
    records: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> Length:
        given = [u for u in ("batches", "epochs", "records") if getattr(self, u) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of batches, epochs or records, e.g. {batches: 1000}; "
                f"got {given or 'none'}"
            )
        return self

    @property
    def unit(self) -> str:
        return next(u for u in ("batches", "epochs", "records") if getattr(self, u) is not None)

    @property
    def value(self) -> int:
        return int(getattr(self, self.unit))

    def counted(
        self, global_batch_size: int | None, records_per_epoch: int | None = None
    ) -> Length:
        """This length as ``{batches: N}`` or ``{epochs: N}``, by the one rule every
        conversion uses: batches stay batches; records are ``N // global_batch_size``
        batches; epochs become ``N * records_per_epoch // global_batch_size`` batches when
        the config gives ``records_per_epoch`` (Determined's rule: the trial's epoch is what
        the config says, not what its data loader happens to yield), else stay epochs of the
        training data loader. Never rounds down to zero batches."""
        gbs = (
            global_batch_size if isinstance(global_batch_size, int) and global_batch_size else None
        )
        if self.unit == "batches":
            return self
        if self.unit == "epochs":
            if records_per_epoch and gbs:
                return Length(batches=max(self.value * records_per_epoch // gbs, 1))
            return self
        if gbs is None:
            raise ConfigError(
                f"length {{records: {self.value}}} needs "
                "hyperparameters.global_batch_size (a positive int) to count batches: add it, "
                "or give the length in batches"
            )
        return Length(batches=max(self.value // gbs, 1))

    def in_batches(
        self, global_batch_size: int | None, records_per_epoch: int | None = None
    ) -> int | None:
        """This length in batches (``counted``'s rule), or None for epochs without
        ``records_per_epoch``: their batches are the data loader's, known only at run time."""
        counted = self.counted(global_batch_size, records_per_epoch)
        return counted.value if counted.unit == "batches" else None


class SearcherConfig(_Strict):
    # A built-in searcher (BUILT_IN_SEARCHERS) or a plug-in's entry point name
    # (det_tasks.config.searcher_plugins); the plug-in's own fields are gathered in plugin_fields.
    name: str
    metric: str
    smaller_is_better: bool = True
    max_length: Length | None = None
    max_trials: int | None = Field(default=None, ge=1)
    max_concurrent_trials: int = Field(default=16, ge=0)
    # adaptive_asha
    time_metric: str | None = None
    max_time: int | None = Field(default=None, ge=1)
    mode: Literal["aggressive", "standard", "conservative"] = "standard"
    divisor: float = Field(default=4.0, gt=1)
    max_rungs: int = Field(default=5, ge=1)
    bracket_rungs: list[int] | None = None
    stop_once: bool = False
    # deprecated: legacy step counts (a step is `scheduling_unit` batches)
    max_steps: int | None = Field(default=None, ge=1)
    source_trial_id: int | None = None
    source_checkpoint_uuid: str | None = None
    # a plug-in searcher's own fields, as written (its SearcherOptions model checks them)
    plugin_fields: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gather_plugin_fields(cls, data: Any) -> Any:
        """A plug-in searcher's own keys go to ``plugin_fields``; under a built-in name, a key
        one of the installed plug-ins owns is refused naming that plug-in."""
        if not isinstance(data, dict):
            return data
        extra = [key for key in data if key not in cls.model_fields]
        if not extra:
            return data
        if data.get("name") in BUILT_IN_SEARCHERS:
            for key in extra:
                owner = plugin_owning(str(key))
                if owner is not None:
                    raise ValueError(
                        f"`searcher.{key}` is for name: {owner} only; remove it or use "
                        f"name: {owner}"
                    )
            return data  # the strict model names the unknown field
        gathered = {**dict(data.get("plugin_fields") or {}), **{k: data[k] for k in extra}}
        kept = {k: v for k, v in data.items() if k in cls.model_fields}
        return {**kept, "plugin_fields": gathered}

    @field_validator("name")
    @classmethod
    def _known_searcher(cls, name: str) -> str:
        if name not in BUILT_IN_SEARCHERS:
            find_searcher_plugin(name)  # ConfigError (a ValueError): not installed, or how
        return name

    @model_validator(mode="after")
    def _needs_length(self) -> SearcherConfig:
        if self.max_length is not None and self.max_steps is not None:
            raise ValueError("give max_length or the deprecated max_steps, not both")
        if self.name not in BUILT_IN_SEARCHERS:
            check = find_searcher_plugin(self.name).check
            if check is not None:
                check(self)
            return self
        if self.plugin_fields:
            raise ValueError(
                f"`searcher.{next(iter(self.plugin_fields))}` is not a field of the built-in "
                f"{self.name} searcher: remove it"
            )
        if self.name in ("random", "adaptive_asha") and self.max_trials is None:
            raise ValueError(f"the {self.name} searcher needs max_trials, e.g. max_trials: 16")
        if self.name == "adaptive_asha" and (self.time_metric is None) != (self.max_time is None):
            raise ValueError(f"{self.name} needs both time_metric and max_time, or neither")
        return self


# A section is validated by its type's backend (det_tasks.checkpoints.backends) and keeps that
# model's fields when dumped.
CheckpointStorageConfig = SerializeAsAny[StorageOptions]


class OptimizationsConfig(_Strict):
    aggregation_frequency: int = Field(default=1, ge=1)
    average_aggregated_gradients: bool = True
    average_training_metrics: bool = True
    gradient_compression: bool = False
    grad_updates_size_file: str | None = None
    mixed_precision: str | None = None
    tensor_fusion_threshold: int | None = None
    tensor_fusion_cycle_time: int | None = None
    auto_tune_tensor_fusion: bool | None = None
    # det_tasks extension: what a NaN/inf training loss does (see pytorch/_api/nonfinite.py).
    nonfinite_loss: Literal["warn", "error", "skip"] = "warn"


class ResourcesConfig(_Strict):
    slots_per_trial: int = Field(default=1, ge=1)
    distributed_backend: Literal["auto", "horovod", "torch"] = "auto"
    # The shared cluster's job queue (cluster.job_queue): Determined's ranges.
    max_slots: int | None = Field(default=None, ge=1)
    priority: int | None = Field(default=None, ge=1, le=99)
    weight: float | None = Field(default=None, gt=0)
    resource_pool: str | None = None
    shm_size: int | str | None = None


class SlurmConfig(_Strict):
    """Determined's ``slurm:`` section: what each of the experiment's worker jobs asks
    Slurm for where the cluster's workers are Slurm jobs (cluster.slurm_workers)."""

    slots_per_node: int | None = Field(default=None, ge=1)
    gpu_type: str | None = None
    sbatch_args: list[str] = Field(default_factory=list)


class ReproducibilityConfig(_Strict):
    experiment_seed: int = Field(default=0, ge=0, lt=2**31)


class ProfilingConfig(_Strict):
    enabled: bool = False
    begin_on_batch: int = Field(default=0, ge=0)
    end_after_batch: int | None = Field(default=None, ge=0)
    sync_timings: bool = True


class ExperimentConfig(_Strict):
    """One experiment, as the user's YAML describes it (Determined 0.38 fields)."""

    name: str | None = None
    description: str | None = None
    labels: list[str] = Field(default_factory=list)
    workspace: str | None = None
    project: str | None = None
    entrypoint: str | list[str]
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    searcher: SearcherConfig
    records_per_epoch: int | None = Field(default=None, ge=1)
    scheduling_unit: int = Field(default=100, ge=1)
    min_validation_period: Length | None = None
    min_checkpoint_period: Length | None = None
    checkpoint_policy: Literal["best", "all", "none"] = "best"
    perform_initial_validation: bool = False
    checkpoint_storage: CheckpointStorageConfig | None = None
    optimizations: OptimizationsConfig = Field(default_factory=OptimizationsConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    max_restarts: int = Field(default=5, ge=0)
    reproducibility: ReproducibilityConfig = Field(default_factory=ReproducibilityConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    data: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    bind_mounts: list[dict[str, Any]] = Field(default_factory=list)
    debug: bool = False
    slurm: SlurmConfig | None = None
    pbs: dict[str, Any] | None = None

    @field_validator("pbs")
    @classmethod
    def _no_pbs(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError(
                "PBS clusters are not supported: run the experiment on a Slurm cluster "
                "(a `slurm:` section, docs/operations/slurm.md) or on the stack's workers, "
                "and remove `pbs:`"
            )
        return None

    @field_validator("checkpoint_storage", mode="before")
    @classmethod
    def _storage_by_type(cls, raw: Any) -> Any:
        return parse_storage(raw)

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _parse_hparams(cls, raw: Any) -> dict[str, Any]:
        return parse_hyperparameters(raw if raw is not None else {})

    @field_validator("name")
    @classmethod
    def _name_accepted(cls, value: str | None) -> str | None:
        problem = None if value is None else experiment_name_problem(value)
        if problem is not None:
            raise ValueError(f"MLflow names the experiment after it, and {problem}")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str | list[str]) -> str | list[str]:
        text = value if isinstance(value, str) else " ".join(value)
        if not text.strip():
            raise ValueError(
                "entrypoint is empty: use `model_def:TrialClass` or `python3 train.py`"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        if self.is_trial_class_entrypoint and "global_batch_size" not in self.hyperparameters:
            raise ValueError(
                "hyperparameters.global_batch_size is missing: PyTorchTrial needs it to size "
                "each slot's batches; add e.g. `global_batch_size: 64` under hyperparameters"
            )
        gbs = self.hyperparameters.get("global_batch_size")
        if isinstance(gbs, ConstHP) and not (isinstance(gbs.val, int) and gbs.val >= 1):
            raise ValueError(
                f"hyperparameters.global_batch_size must be a positive integer, got {gbs.val!r}"
            )
        # A Trainer-API script says how long it trains in fit(max_length=...), so it needs
        # no searcher length (Determined accepts such a config); a trial class and ASHA's
        # rungs do.
        needs_length = self.is_trial_class_entrypoint or self.searcher.name == "adaptive_asha"
        if needs_length and not self.has_max_length:
            raise ValueError(
                "searcher.max_length is missing: say how long to train, "
                "e.g. `max_length: {batches: 1000}` or `{epochs: 5}`"
                + (" (or time_metric + max_time)" if self.searcher.name == "adaptive_asha" else "")
            )
        self._searcher_counts_in_batches()
        if self.searcher.name == "grid":
            problem = grid_problem(self.hyperparameters, self.searcher.max_trials)
            if problem is not None:
                raise ValueError(problem)
        return self

    @property
    def has_max_length(self) -> bool:
        """Whether the searcher says how long trials train (else a script's fit() does)."""
        s = self.searcher
        return (
            s.max_length is not None
            or s.max_steps is not None
            or (s.name not in ("single", "grid", "random") and s.max_time is not None)
        )

    @property
    def is_trial_class_entrypoint(self) -> bool:
        """True for ``module:TrialClass``; False for a command such as ``python3 train.py``."""
        if not isinstance(self.entrypoint, str):
            return False
        text = self.entrypoint.strip()
        return " " not in text and ":" in text

    @property
    def max_length(self) -> Length:
        """The searcher's length, with the deprecated ``max_steps`` translated to batches."""
        if not self.has_max_length:
            raise ConfigError(
                "searcher.max_length is not set: this script's own fit(max_length=...) "
                "decides how long it trains; set searcher.max_length to have the searcher "
                "decide"
            )
        if self.searcher.max_length is not None:
            return self.searcher.max_length
        if self.searcher.max_steps is not None:
            return Length(batches=self.searcher.max_steps * self.scheduling_unit)
        assert self.searcher.max_time is not None
        unit = self.searcher.time_metric or "batches"
        if unit not in ("batches", "epochs", "records"):
            raise ValueError(f"searcher.time_metric {unit!r} is not a training length unit")
        return Length(**{unit: self.searcher.max_time})

    @property
    def global_batch_size(self) -> int | None:
        """``hyperparameters.global_batch_size`` when it is a constant int, else None."""
        gbs = self.hyperparameters.get("global_batch_size")
        value = gbs.val if isinstance(gbs, ConstHP) else None
        return value if isinstance(value, int) and value >= 1 else None

    def max_length_in_batches(self) -> int | None:
        """The searcher's length in batches (``Length.counted``'s rule), or None for epochs
        without ``records_per_epoch``."""
        return self.max_length.in_batches(self.global_batch_size, self.records_per_epoch)

    def _searcher_counts_in_batches(self) -> None:
        """A searcher that places rungs in batches (adaptive_asha, a plug-in saying so) is
        refused a length it cannot count, when the config is read (check-config too)."""
        s = self.searcher
        if s.name in BUILT_IN_SEARCHERS:
            counts = s.name == "adaptive_asha"
        else:
            counts_in_batches = find_searcher_plugin(s.name).counts_in_batches
            counts = counts_in_batches is not None and counts_in_batches(s)
        if not counts or not self.has_max_length or self.max_length_in_batches() is not None:
            return
        length = self.max_length
        raise ValueError(
            f"searcher {s.name} places its rungs in batches, and a length of "
            f"{{epochs: {length.value}}} has a number of batches only with records_per_epoch: "
            "add records_per_epoch (the training records in one epoch), or give the length "
            "in batches or records"
        )
