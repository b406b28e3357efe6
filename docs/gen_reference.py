"""Reference pages generated from the code, so they cannot drift from it.

Used two ways: as a MkDocs hook (``hooks:`` in mkdocs.yml), where a page's marker line
``<!-- generated: NAME -->`` is replaced by the generated Markdown while the site builds;
and by ``tests/unit/test_docs_reference.py``, which checks that every config field has a
note here and that every ``det``/``det-tasks`` command appears.

- ``config``: every field of ``det_tasks.config.experiment.ExperimentConfig`` (and of the
  hyperparameter and job models), its type and default read from the pydantic model, plus
  the note below saying what the field does here. A field without a note, or a note for a
  field that no longer exists, raises, so the build fails in ``mkdocs build --strict``.
- ``cli-det`` / ``cli-det-tasks``: the argparse parsers of ``det`` (det_cli/) and
  ``det-tasks`` (det_tasks/runner/cli.py), walked command by command.
- ``packages``: every package import-linter knows (pyproject.toml's ``root_packages``) and
  each of its modules with its docstring's first line, read with ``ast`` (nothing is
  imported); a module without a docstring fails the build.
- ``layers`` / ``dynamic-imports``: pyproject.toml's import-linter contracts, and its
  ``[tool.det_tasks.dynamic_imports]`` with the entry points each group holds.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = [
    "CONFIG_NOTES",
    "FIELD_TESTS",
    "cli_markdown",
    "config_field_paths",
    "config_markdown",
    "det_parser",
    "det_tasks_parser",
    "dynamic_imports_markdown",
    "generate",
    "layers_markdown",
    "on_page_markdown",
    "package_modules",
    "packages_markdown",
    "project_packages",
    "summary_line",
]

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

# What each field does here. "Warns" = accepted with a warning naming the field; "no effect"
# = accepted so Determined YAML loads unchanged, and nothing reads it.
CONFIG_NOTES: dict[str, str] = {
    "name": "MLflow experiment name; the trials of one config share it. "
    "Default: the config file's stem, decided once where the config is submitted and "
    "sent to every worker with the config.",
    "description": "Shown on the MLflow experiment and parent run.",
    "labels": "No effect: add labels with `det experiment label add ID LABEL` (MLflow tags).",
    "workspace": "No effect: experiments are grouped by MLflow experiment (`name`).",
    "project": "No effect: experiments are grouped by MLflow experiment (`name`).",
    "entrypoint": "`module:TrialClass` (a `PyTorchTrial`), or a command such as "
    "`python3 train.py` (Trainer API), optionally behind "
    "`python3 -m determined.launch.torch_distributed` or `...launch.horovod`.",
    "hyperparameters": "Constants, nested groups and searchable `const`/`int`/`double`/`log`/"
    "`categorical` entries ([Hyperparameters](#hyperparameters)). A trial class needs "
    "`global_batch_size`.",
    "searcher": "How trials are chosen and how long they train ([searcher](#searcher)).",
    "records_per_epoch": "Converts an `{epochs: N}` length to batches when the data loader "
    "cannot say how long an epoch is.",
    "scheduling_unit": 'Batches per legacy "step" (`max_steps`, `*.steps`, '
    "`batches_per_step` are translated with a DeprecationWarning).",
    "min_validation_period": "Validate at least this often (a [length](#length)).",
    "min_checkpoint_period": "Checkpoint at least this often (a [length](#length)).",
    "checkpoint_policy": "`best`: also checkpoint a validation that beats the best so far "
    "(ranked by `searcher.metric`); `all`: after every validation; `none`: only periods "
    "and the end.",
    "perform_initial_validation": "Validate once before training starts.",
    "checkpoint_storage": "Where checkpoints go without MLflow, and how many are kept "
    "([checkpoint_storage](#checkpoint_storage)). With `MLFLOW_TRACKING_URI` set, checkpoints "
    "are artifacts of the trial's MLflow run in S3 whatever the type; the `save_*` counts "
    "still apply.",
    "optimizations": "Gradient aggregation, Horovod tuning, non-finite losses "
    "([optimizations](#optimizations)).",
    "resources": "Processes per trial and the distributed backend ([resources](#resources)).",
    "max_restarts": "Prefect retries of a failed trial segment (each resumes from the "
    "trial's newest checkpoint).",
    "reproducibility": "Seeds ([reproducibility](#reproducibility)).",
    "profiling": "Phase timings reported through the metrics sink ([profiling](#profiling)).",
    "data": "Free-form; the trial reads it with `context.get_data_config()`.",
    "environment": "No effect: the worker's Python environment is the platform's (install "
    "your dependencies there, or build `infra/Dockerfile`'s image).",
    "bind_mounts": "No effect: mount storage on the worker hosts (or in the work pool's job "
    "template).",
    "debug": "No effect: set log levels with Python's `logging`.",
    "slurm": "Each worker job's request where workers are Slurm jobs (its table below).",
    "pbs": "Refused when the config is read: PBS clusters are not supported; use a Slurm "
    "cluster (`slurm:`) or the stack's workers.",
    # slurm
    "slurm.slots_per_node": "Where workers are Slurm jobs ([Running on "
    "Slurm](../operations/slurm.md)): the GPUs each of the experiment's worker jobs asks for "
    "(`--gres`), default `resources.slots_per_trial` when the experiment uses GPUs.",
    "slurm.gpu_type": "The GPU type in each worker job's `--gres=gpu:TYPE:N`.",
    "slurm.sbatch_args": "Passed to `sbatch` for each of the experiment's worker jobs, after "
    "the cluster's own; checked with `sbatch --test-only` before the first trial.",
    # searcher
    "searcher.name": "`single`, `grid`, `random`, `adaptive_asha`, or an installed plug-in's "
    "name: `optuna` (model-based, with the `optuna` extra), or one of your own "
    "([searchers](../concepts/searchers.md#adding-a-searcher)). An unknown name is refused "
    "when the config is read, listing the built-in and installed ones. `custom` passes "
    "validation, then a flow refuses it naming the supported ones; removed Determined names "
    "(`adaptive`, `adaptive_simple`, `pbt`, `sync_halving`, `async_halving`) are refused at "
    "load time.",
    "searcher.plugin_fields": "Filled in when the config is read, not written: a plug-in "
    "searcher's own fields (optuna's `sampler`, `pruner`) go directly under `searcher:`, are "
    "gathered here and checked by the plug-in's model (its table below).",
    "searcher.metric": "Validation metric that ranks trials and checkpoints.",
    "searcher.smaller_is_better": "Direction of `metric`.",
    "searcher.sampler": "`tpe` (default), `cmaes`, `gp`, `random`, `qmc`, "
    "seeded by `reproducibility.experiment_seed`; `cmaes` refuses categorical hyperparameters.",
    "searcher.pruner": "`asha` (default), `hyperband`, `median`, `none`; judges "
    "each validation at `adaptive_asha`'s rung lengths (`divisor`, `max_rungs`).",
    "searcher.max_length": "How long each trial trains (a [length](#length)); required for a "
    "trial class and for `adaptive_asha`, optional for a Trainer-API script.",
    "searcher.max_trials": "Trials to run (`random`, `adaptive_asha`: required); truncates "
    "the grid for `grid`.",
    "searcher.max_concurrent_trials": "Trials running at once in a flow (0 is read as 1).",
    "searcher.time_metric": "`adaptive_asha` only, with `max_time`: the unit (`batches`, "
    "`epochs`, `records`) of `max_time`.",
    "searcher.max_time": "`adaptive_asha` only, with `time_metric`: the length in that unit.",
    "searcher.mode": "`adaptive_asha` bracket layout, as Determined's.",
    "searcher.divisor": "`adaptive_asha` reduction factor between rungs.",
    "searcher.max_rungs": "`adaptive_asha` rungs at most (also capped by length and trials).",
    "searcher.bracket_rungs": "`adaptive_asha` explicit rungs per bracket (overrides `mode`).",
    "searcher.stop_once": "`adaptive_asha` stopping variant: each trial judged once per rung.",
    "searcher.max_steps": "Deprecated: read as `max_length: {batches: max_steps * "
    "scheduling_unit}`, with a DeprecationWarning.",
    "searcher.source_trial_id": "Warm start from that trial's most recent checkpoint "
    "(looked up in MLflow).",
    "searcher.source_checkpoint_uuid": "Warm start from that checkpoint (the trial's storage, "
    "then MLflow).",
    # checkpoint_storage
    "checkpoint_storage.shared_fs.type": "`shared_fs`.",
    "checkpoint_storage.shared_fs.host_path": "Directory checkpoints are written under.",
    "checkpoint_storage.shared_fs.storage_path": "Subdirectory of `host_path`.",
    "checkpoint_storage.shared_fs.container_path": "No effect (there are no containers).",
    "checkpoint_storage.shared_fs.propagation": "No effect (there are no bind mounts).",
    "checkpoint_storage.directory.type": "`directory`.",
    "checkpoint_storage.directory.container_path": "Directory checkpoints are written to.",
    "checkpoint_storage.s3.type": "`s3`. Needs MLflow (`MLFLOW_TRACKING_URI`): without it "
    "`det-tasks run` refuses the config and says so.",
    "checkpoint_storage.s3.bucket": "No effect: the bucket comes from "
    "`DET_TASKS_MLFLOW_ARTIFACTS` (the MLflow server's artifact root).",
    "checkpoint_storage.s3.prefix": "No effect (see `bucket`).",
    "checkpoint_storage.s3.endpoint_url": "No effect: clients use `MLFLOW_S3_ENDPOINT_URL`.",
    "checkpoint_storage.s3.access_key": "No effect: clients use `AWS_ACCESS_KEY_ID`.",
    "checkpoint_storage.s3.secret_key": "No effect: clients use `AWS_SECRET_ACCESS_KEY`.",
    "checkpoint_storage.*.save_experiment_best": "Keep the best N checkpoints of the "
    "experiment (`det-tasks gc`, and at the end of a flow).",
    "checkpoint_storage.*.save_trial_best": "Keep each trial's best N checkpoints.",
    "checkpoint_storage.*.save_trial_latest": "Keep each trial's latest N checkpoints.",
    # optimizations
    "optimizations.aggregation_frequency": "Batches whose gradients make one optimizer step "
    "(also `init(aggregation_frequency=)`; a conflict between the two is an error).",
    "optimizations.average_aggregated_gradients": "Average (not sum) aggregated gradients.",
    "optimizations.average_training_metrics": "Average training metrics across ranks.",
    "optimizations.gradient_compression": "Horovod fp16 compression; warns under torch DDP.",
    "optimizations.grad_updates_size_file": "No effect.",
    "optimizations.mixed_precision": "Deprecated, no effect: any value but `O0` warns and "
    "names `wrap_scaler` / `experimental.use_amp()`.",
    "optimizations.tensor_fusion_threshold": "Horovod: `HOROVOD_FUSION_THRESHOLD` (MB).",
    "optimizations.tensor_fusion_cycle_time": "Horovod: `HOROVOD_CYCLE_TIME` (ms).",
    "optimizations.auto_tune_tensor_fusion": "Horovod: `HOROVOD_AUTOTUNE`.",
    "optimizations.nonfinite_loss": "det-tasks extension. A NaN/inf training loss: `warn` "
    "trains on (Determined's behaviour), `error` stops the trial naming the batch, `skip` "
    "drops the batch's update (single process only).",
    # resources
    "resources.slots_per_trial": "Processes per trial (torchrun or horovodrun), one per GPU "
    "when there are GPUs.",
    "resources.distributed_backend": "`auto` (Horovod when installed, else torch), "
    "`horovod` or `torch`.",
    "resources.max_slots": "The most slots the experiment holds at once in the cluster's job "
    "queue ([Shared cluster](../operations/shared-cluster.md)); `det job update --max-slots`.",
    "resources.priority": "1 to 99 (default 42), lower is more urgent: the job queue serves "
    "more urgent experiments first and preempts less urgent trials "
    "([Shared cluster](../operations/shared-cluster.md)).",
    "resources.shm_size": "Warns (`UnhonouredFieldWarning`): set it in the work pool's job "
    "template.",
    "resources.weight": "Fair share within one priority: each free slot goes to the experiment "
    "holding the fewest slots per unit of weight.",
    "resources.resource_pool": "The pool of workers its trials run on (workers join pool NAME "
    "with the Dask resource `pool-NAME`); a pool the cluster lacks is refused, naming its "
    "pools.",
    # reproducibility
    "reproducibility.experiment_seed": "Seeds Python, NumPy and torch per trial, and the "
    "searcher's draws.",
    # profiling
    "profiling.enabled": "Report phase timings, CPU, memory and peak GPU memory once at the end.",
    "profiling.begin_on_batch": "First profiled batch.",
    "profiling.end_after_batch": "Last profiled batch (default: to the end).",
    "profiling.sync_timings": "Synchronise CUDA around timed phases (exact, slower).",
    # length
    "length.batches": "Give exactly one of the three units.",
    "length.epochs": "Epochs (the loader's length, or `records_per_epoch`).",
    "length.records": "Records (divided by `global_batch_size`).",
    # hyperparameters
    "hp.const.type": "`const`.",
    "hp.const.val": "The value (a bare value in the YAML is the same as `const`).",
    "hp.int.type": "`int`.",
    "hp.int.minval": "Lower bound, inclusive.",
    "hp.int.maxval": "Upper bound, inclusive.",
    "hp.int.count": "Grid points (`grid` searcher).",
    "hp.double.type": "`double`.",
    "hp.double.minval": "Lower bound.",
    "hp.double.maxval": "Upper bound.",
    "hp.double.count": "Grid points (`grid` searcher).",
    "hp.log.type": "`log`: values are `base ** x`, x uniform in [minval, maxval].",
    "hp.log.minval": "Lower exponent.",
    "hp.log.maxval": "Upper exponent.",
    "hp.log.base": "Base of the exponent.",
    "hp.log.count": "Grid points (`grid` searcher).",
    "hp.categorical.type": "`categorical`.",
    "hp.categorical.vals": "The choices.",
    # det job run
    "job.name": "Name of the job's flow run and MLflow run.",
    "job.description": "Shown on the job's MLflow run.",
    "job.entrypoint_script": "`python3 batch_inference.py`: a script that reads "
    "`context.config_data` (the `data` section).",
    "job.entrypoint": "Same as `entrypoint_script` (give one of the two).",
    "job.data": "The script's `config_data`; without a script, the built-in batch "
    "inference's parameters (`model_uri` required).",
    "job.resources": "`slots_per_trial` for a distributed script.",
    "job.environment": "No effect (see the experiment field).",
    "job.max_restarts": "Prefect retries; a restarted job skips the batches its progress "
    "checkpoint covers.",
}


_UNIT = "tests/unit/"
_INTEGRATION = "tests/integration/"

# The tests that show a field doing what its note says (the reference's "test" column).
# tests/unit/test_docs_reference.py checks that every one exists.
FIELD_TESTS: dict[str, list[str]] = {
    "hyperparameters": [
        _UNIT + "test_bad_input.py::test_missing_global_batch_size",
        _UNIT + "test_bad_input.py::test_unknown_hparam_names_the_defined_ones",
    ],
    "scheduling_unit": [_UNIT + "test_bad_input.py::test_deprecated_field_warns_and_translates"],
    "checkpoint_policy": [
        _UNIT + "test_bad_input.py::test_typo_in_checkpoint_policy_is_not_silently_accepted",
        _UNIT + "test_paths_and_policies.py::test_best_policy_under_a_search_compares_with_the_"
        "experiment_best",
    ],
    "max_restarts": [
        _INTEGRATION
        + "test_embedded.py::test_a_failing_trial_ends_failed_everywhere_with_one_last_line",
        _INTEGRATION + "test_faults.py",
    ],
    "searcher.max_length": [_UNIT + "test_bad_input.py::test_missing_max_length_in_local_training"],
    "searcher.max_concurrent_trials": [
        _INTEGRATION + "test_flows.py::test_grid_of_four_with_concurrency_two",
        _INTEGRATION + "test_dask_memory.py::test_workers_fit_the_hosts_available_memory",
    ],
    "searcher.divisor": [_INTEGRATION + "test_flows.py::test_asha_stops_worse_trials_early"],
    "searcher.sampler": [
        _UNIT + "test_optuna_searcher.py::test_every_sampler_proposes_seeded_points_in_range",
        _UNIT + "test_optuna_searcher.py::test_bad_sampler_and_pruner_names_name_the_field",
    ],
    "searcher.pruner": [
        _UNIT + "test_optuna_searcher.py::test_asha_pruner_stops_a_clearly_worse_trial_at_the_"
        "first_rung",
        _INTEGRATION + "test_optuna_flow.py::test_optuna_search_runs_on_the_flow",
    ],
    "searcher.mode": [
        _UNIT + "test_searcher_invalid_hp.py::test_asha_brackets_follow_mode_and_bracket_rungs_as_"
        "determined"
    ],
    "searcher.bracket_rungs": [
        _UNIT + "test_searcher_invalid_hp.py::test_bracket_rungs_config_is_used"
    ],
    "searcher.stop_once": [
        _UNIT + "test_searcher_invalid_hp.py::test_asha_stop_once_judges_each_trial_once_when_it_"
        "finishes_a_rung"
    ],
    "searcher.max_steps": [_UNIT + "test_bad_input.py::test_deprecated_field_warns_and_translates"],
    "searcher.source_trial_id": [
        _INTEGRATION
        + "test_checkpoint_import.py::test_import_adopts_every_layout_signed_and_registered",
        _UNIT + "test_warm_start.py::test_source_trial_id_without_a_registry_names_the_field",
    ],
    "searcher.source_checkpoint_uuid": [
        _UNIT + "test_warm_start.py::test_source_checkpoint_uuid_initialises_weights_and_restarts_"
        "progress"
    ],
    "checkpoint_storage.*.save_experiment_best": [
        _INTEGRATION + "test_registry.py::test_gc_keeps_policy_and_registered_versions"
    ],
    "checkpoint_storage.*.save_trial_best": [
        _INTEGRATION + "test_registry.py::test_gc_keeps_policy_and_registered_versions"
    ],
    "checkpoint_storage.*.save_trial_latest": [
        _INTEGRATION + "test_registry.py::test_gc_keeps_policy_and_registered_versions"
    ],
    "optimizations.aggregation_frequency": [
        _UNIT + "test_optimization.py::test_aggregation_frequency_from_experiment_config",
        _UNIT + "test_optimization.py::test_conflicting_aggregation_frequency_is_refused",
    ],
    "optimizations.gradient_compression": [
        _UNIT + "test_unhonoured_fields.py::test_gradient_compression_reaches_wrap_optimizer"
    ],
    "optimizations.tensor_fusion_threshold": [
        _UNIT + "test_unhonoured_fields.py::test_tensor_fusion_fields_become_horovod_environment"
    ],
    "optimizations.tensor_fusion_cycle_time": [
        _UNIT + "test_unhonoured_fields.py::test_tensor_fusion_fields_become_horovod_environment"
    ],
    "optimizations.auto_tune_tensor_fusion": [
        _UNIT + "test_unhonoured_fields.py::test_tensor_fusion_fields_become_horovod_environment"
    ],
    "optimizations.nonfinite_loss": [_UNIT + "test_nonfinite_loss.py"],
    "resources.slots_per_trial": [
        _INTEGRATION + "test_distributed.py::test_two_ranks_match_one_process_every_step",
        _UNIT + "test_gpu_groups.py::test_more_slots_than_gpus_is_refused_naming_the_field",
    ],
    "resources.distributed_backend": [
        _INTEGRATION + "test_distributed.py::test_two_ranks_match_one_process_every_step"
    ],
    "resources.max_slots": [
        _UNIT + "test_unhonoured_fields.py::test_unhonoured_field_warns_naming_it"
    ],
    "resources.priority": [
        _UNIT + "test_unhonoured_fields.py::test_unhonoured_field_warns_naming_it"
    ],
    "resources.shm_size": [
        _UNIT + "test_unhonoured_fields.py::test_unhonoured_field_warns_naming_it"
    ],
    "job.entrypoint_script": [_UNIT + "test_packaging.py::test_job_config_forms"],
    "job.entrypoint": [_UNIT + "test_packaging.py::test_job_config_forms"],
    "job.data": [_INTEGRATION + "test_submit.py"],
    "job.max_restarts": [_INTEGRATION + "test_batch_jobs.py"],
}


def _tests_cell(key: str) -> str:
    names = FIELD_TESTS.get(key, [])
    return "<br>".join(f"`{n.split('/')[-1]}`" for n in names)


def _models() -> Iterator[tuple[str, str, type[BaseModel], str]]:
    """(section title, anchor, model, note-key prefix) for every config section."""
    from det_tasks.config import experiment as exp
    from det_tasks.config import hyperparameters as hp
    from det_tasks.config.job import JobConfig

    yield "Top level", "top-level", exp.ExperimentConfig, ""
    yield "searcher", "searcher", exp.SearcherConfig, "searcher."
    yield "length", "length", exp.Length, "length."
    for i, (kind, options) in enumerate(_storage_options()):
        anchor = "checkpoint_storage" if i == 0 else f"storage-{kind}"
        yield f"checkpoint_storage: {kind}", anchor, options, f"checkpoint_storage.{kind}."
    yield "optimizations", "optimizations", exp.OptimizationsConfig, "optimizations."
    yield "resources", "resources", exp.ResourcesConfig, "resources."
    yield "reproducibility", "reproducibility", exp.ReproducibilityConfig, "reproducibility."
    yield "profiling", "profiling", exp.ProfilingConfig, "profiling."
    yield "slurm", "slurm", exp.SlurmConfig, "slurm."
    for name, options in _plugin_options():
        yield f"searcher: {name} (plug-in)", f"searcher-{name}", options, "searcher."
    for name, model in (
        ("const", hp.ConstHP),
        ("int", hp.IntHP),
        ("double", hp.DoubleHP),
        ("log", hp.LogHP),
        ("categorical", hp.CategoricalHP),
    ):
        yield f"hyperparameters: {name}", f"hp-{name}", model, f"hp.{name}."
    yield "Job config (`det job run`)", "job-config", JobConfig, "job."


def _storage_options() -> list[tuple[str, type[BaseModel]]]:
    """Each installed checkpoint storage type and its model (det_tasks.checkpoints.backends)."""
    from det_tasks.checkpoints.backends import STORAGE_BACKENDS, find_backend
    from det_tasks.plugins import entry_names

    return [(kind, find_backend(kind).options) for kind in entry_names(STORAGE_BACKENDS)]


def _plugin_options() -> list[tuple[str, type[BaseModel]]]:
    """Each installed searcher plug-in with fields of its own, and their model."""
    from det_tasks.config.searcher_plugins import SEARCHER_PLUGINS, find_searcher_plugin
    from det_tasks.plugins import entry_names

    found = [(n, find_searcher_plugin(n).options) for n in sorted(entry_names(SEARCHER_PLUGINS))]
    return [(name, options) for name, options in found if options.model_fields]


def _note_key(prefix: str, field: str) -> str:
    key = prefix + field
    if key.startswith("checkpoint_storage.") and field.startswith("save_"):
        return f"checkpoint_storage.*.{field}"
    return key


# A plug-in or storage type installed from another package documents its own fields: its
# model's field descriptions stand in for notes, so installing one never breaks this build.
PROJECT_PACKAGES = ("det_tasks", "registry", "cluster", "flows", "det_cli", "infra")


def _ours(model: type[BaseModel]) -> bool:
    return model.__module__.partition(".")[0] in PROJECT_PACKAGES


def config_field_paths() -> list[str]:
    """Every note key the config models of this project need (one per field)."""
    return list(
        dict.fromkeys(
            _note_key(prefix, field)
            for _, _, model, prefix in _models()
            if _ours(model)
            for field in model.model_fields
        )
    )


def _foreign_note(model: type[BaseModel], info: FieldInfo) -> str:
    """What another package's plug-in field says of itself, and whose it is."""
    owner = f"from `{model.__module__.partition('.')[0]}`"
    return _cell(f"{info.description} ({owner})") if info.description else owner


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in args if a is not type(None)]
        kinds = [_type_tag(a) for a in parts]
        if all(kinds):
            text = "mapping by `type`: " + ", ".join(f"`{k}`" for k in kinds)
            return f"{text} \\| null" if len(parts) < len(args) else text
        text = " \\| ".join(_type_name(a) for a in parts)
        return f"{text} \\| null" if len(parts) < len(args) else text
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation.__name__ == "StorageOptions":  # validated by its type's own model
            return "mapping by `type`: " + ", ".join(f"`{k}`" for k, _ in _storage_options())
        if annotation.__name__ == "Length":
            return "[length](#length)"
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _type_tag(annotation: Any) -> str | None:
    """The ``type`` literal of a tagged config model (checkpoint storage), else None."""
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    field = annotation.model_fields.get("type")
    args = typing.get_args(field.annotation) if field else ()
    return str(args[0]) if len(args) == 1 else None


def _bounds(info: FieldInfo) -> str:
    out = []
    for item in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
        if getattr(item, "min_length", None) is not None:
            out.append(f"length >= {item.min_length}")
    return f" ({', '.join(out)})" if out else ""


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "see below"
        return f"`{value!r}`"
    if info.default is PydanticUndefined or info.default is None:
        return "none"
    if isinstance(info.default, bool):
        return f"`{str(info.default).lower()}`"
    return f"`{info.default!r}`".replace("'", '"')


def config_markdown() -> str:
    """The config reference tables; raises when a field has no note or a note is stale."""
    needed = config_field_paths()
    missing = [k for k in needed if k not in CONFIG_NOTES]
    stale = [k for k in [*CONFIG_NOTES, *FIELD_TESTS] if k not in needed]
    if missing or stale:
        raise RuntimeError(
            f"docs/gen_reference.py CONFIG_NOTES is out of step with det_tasks.config: "
            f"fields without a note {missing}, notes for no field {stale}"
        )
    lines: list[str] = []
    for title, anchor, model, prefix in _models():
        lines += [f"### {title} {{#{anchor}}}", ""]
        lines += [
            "| field | type | default | here | test |",
            "| --- | --- | --- | --- | --- |",
        ]
        for field, info in model.model_fields.items():
            key = _note_key(prefix, field)
            kind = _type_name(info.annotation) + _bounds(info)
            note = CONFIG_NOTES[key] if _ours(model) else _foreign_note(model, info)
            row = f"| `{field}` | {kind} | {_default(info)} | {note} |"
            lines.append(f"{row} {_tests_cell(key)} |")
        lines.append("")
    return "\n".join(lines)


def det_parser() -> argparse.ArgumentParser:
    from det_cli.dispatch import build_parser

    return build_parser()


def det_tasks_parser() -> argparse.ArgumentParser:
    from det_tasks.runner.cli import _parser

    return _parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, list[str], str, Any]]:
    """(name, aliases, help, parser) per subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: dict[int, tuple[str, list[str], str, Any]] = {}
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    seen[id(sub)][1].append(name)
                else:
                    seen[id(sub)] = (name, [], helps.get(name, ""), sub)
            return list(seen.values())
    return []


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows, refused = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if hasattr(action, "instead"):
            refused.append(f"| `{', '.join(action.option_strings)}` | {_cell(action.instead)} |")
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += f" {action.metavar or action.dest.upper()}"
        else:
            name = str(action.metavar or action.dest)
        default = action.default
        shown = (
            ""
            if default in (None, False, [], argparse.SUPPRESS)
            or not action.option_strings
            or "default" in (action.help or "")
            else f" (default: `{default}`)"
        )
        rows.append(f"| `{name}` | {_cell(action.help or '')}{shown} |")
    out = []
    if rows:
        out += ["| argument | meaning |", "| --- | --- |", *rows, ""]
    if refused:
        out += ["Refused, with the message:", "", "| flag | use instead |", "| --- | --- |"]
        out += [*refused, ""]
    return out


def _walk(parser: argparse.ArgumentParser, path: str, depth: int) -> list[str]:
    lines: list[str] = []
    commands = _subcommands(parser)
    supported = [c for c in commands if "instead" not in c[3]._defaults]
    unsupported = [c for c in commands if "instead" in c[3]._defaults]
    for name, aliases, help_text, sub in supported:
        full = f"{path} {name}"
        heading = "#" * min(depth, 6)
        alias = f" (alias: {', '.join(f'`{a}`' for a in aliases)})" if aliases else ""
        lines += [f"{heading} `{full}`", ""]
        if help_text or alias:
            lines += [f"{help_text[:1].upper()}{help_text[1:]}{alias}".strip(), ""]
        if not _subcommands(sub):
            usage = " ".join(sub.format_usage().split())
            lines += ["```text", usage.removeprefix("usage: "), "```", ""]
        lines += _arguments(sub)
        lines += _walk(sub, full, depth + 1)
    if unsupported:
        lines += [f"Not supported under `{path}` (one line naming the alternative, exit 2):", ""]
        lines += ["| command | use instead |", "| --- | --- |"]
        for name, _, _, sub in unsupported:
            lines.append(f"| `{path} {name}` | {_cell(sub._defaults['instead'])} |")
        lines.append("")
    return lines


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """A command reference: usage, arguments and subcommands, recursively."""
    prog = parser.prog
    lines = ["```text", " ".join(parser.format_usage().split()).removeprefix("usage: "), "```"]
    lines += ["", *_arguments(parser), *_walk(parser, prog, 3)]
    return "\n".join(lines)


# --- packages and layers, read from the code and pyproject.toml ---------------------------

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def project_packages() -> list[str]:
    """The project's packages, as import-linter's contracts name them."""
    return list(_pyproject()["tool"]["importlinter"]["root_packages"])


def package_modules(package: str) -> Iterator[tuple[str, str]]:
    """(module, its docstring's summary) for every importable module of ``package``:
    folders without ``__init__.py`` (bench's model directories) are data, not modules. A
    module without a docstring raises, so the strict build fails naming it."""
    top = ROOT / package
    for path in sorted(top.rglob("*.py")):
        inner = path.parent.relative_to(top).parts
        folders = [top.joinpath(*inner[:i]) for i in range(len(inner) + 1)]
        if not all((f / "__init__.py").is_file() for f in folders):
            continue
        parts = [package, *path.relative_to(top).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if not doc:
            raise RuntimeError(f"{path.relative_to(ROOT)} has no docstring: say what it is for")
        yield ".".join(parts), summary_line(doc)


def summary_line(docstring: str) -> str:
    """A docstring's summary on one line: its first sentence (first paragraph, unwrapped)."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


def packages_markdown() -> str:
    """Every package and module with its docstring's first line."""
    lines: list[str] = []
    for package in project_packages():
        modules = list(package_modules(package))
        lines += [f"### `{package}/` {{#{package}}}", "", _cell(modules[0][1]), ""]
        lines += ["| module | what it is |", "| --- | --- |"]
        lines += [f"| `{name}` | {_cell(first)} |" for name, first in modules[1:]]
        lines.append("")
    return "\n".join(lines)


def _modules_cell(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "none"


def layers_markdown() -> str:
    """The import-linter contracts of pyproject.toml: the layers top first, then the rest."""
    contracts = _pyproject()["tool"]["importlinter"]["contracts"]
    lines: list[str] = []
    for contract in (c for c in contracts if c["type"] == "layers"):
        lines += [f"**{contract['name']}** (top first):", ""]
        for i, layer in enumerate(contract["layers"], 1):
            siblings = [p.strip() for p in layer.split("|")]
            side = " (side by side: neither imports the other)" if len(siblings) > 1 else ""
            lines.append(f"{i}. {' | '.join(f'`{p}`' for p in siblings)}{side}")
        lines.append("")
    lines += ["| contract | kind | modules | forbidden | declared exceptions |"]
    lines += ["| --- | --- | --- | --- | --- |"]
    for contract in (c for c in contracts if c["type"] != "layers"):
        sources = contract.get("source_modules", contract.get("ancestors", []))
        lines.append(
            f"| {_cell(contract['name'])} | {contract['type']} | {_modules_cell(sources)} | "
            f"{_modules_cell(contract.get('forbidden_modules', []))} | "
            f"{_modules_cell(contract.get('ignore_imports', []))} |"
        )
    return "\n".join([*lines, ""])


def dynamic_imports_markdown() -> str:
    """The loads import-linter cannot see: entry-point groups (who loads each, what its
    entries name) and the modules that import by name, from pyproject.toml."""
    project = _pyproject()
    declared = project["tool"]["det_tasks"]["dynamic_imports"]
    points = project["project"].get("entry-points", {})
    lines = ["| entry-point group | loaded by | entries | may name |", "| --- | --- | --- | --- |"]
    for group, rule in declared["groups"].items():
        entries = [f"{name} = {target}" for name, target in points.get(group, {}).items()]
        lines.append(
            f"| `{group}` | {_modules_cell(rule['loaded_by'])} | {_modules_cell(entries)} | "
            f"{_modules_cell(rule['may_name'])} |"
        )
    lines += ["", "Modules that import a module by name (`importlib.import_module`): "]
    lines[-1] += _modules_cell(declared["by_name"]) + "."
    return "\n".join([*lines, ""])


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_markdown,
    "cli-det": lambda: cli_markdown(det_parser()),
    "cli-det-tasks": lambda: cli_markdown(det_tasks_parser()),
    "packages": packages_markdown,
    "layers": layers_markdown,
    "dynamic-imports": dynamic_imports_markdown,
}


def generate(name: str) -> str:
    if name not in GENERATORS:
        raise KeyError(f"no generated section {name!r}; known: {sorted(GENERATORS)}")
    return GENERATORS[name]()


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: expand ``<!-- generated: NAME -->`` markers."""
    return MARKER.sub(lambda m: generate(m.group(1)), markdown)
