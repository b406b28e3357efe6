"""``init()`` and ``Trainer``: Determined's local Trainer API over our loop.

``init`` builds a context (seeds, device, distributed group, sinks, store); ``Trainer.fit``
checks its arguments once and hands a ``FitOptions`` to the loop.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from det_tasks import cluster_info, run_services
from det_tasks.checkpoints.backends import store_from_config
from det_tasks.checkpoints.store import CheckpointStore, LocalDirectoryStore
from det_tasks.config.experiment import Length
from det_tasks.config.horovod import horovod_tuning_env
from det_tasks.config.hyperparameters import sample_hparams
from det_tasks.config.lengths import in_batches_or_epochs
from det_tasks.config.loader import parse_config
from det_tasks.distributed import DistributedContext
from det_tasks.errors import ConfigError, TrialError
from det_tasks.pytorch._api.context import PyTorchTrialContext, TrialSettings
from det_tasks.pytorch._api.legacy import adapt_trial
from det_tasks.pytorch._data.units import Batch, Epoch, TrainUnit
from det_tasks.pytorch._loading.load import load_trial_from_checkpoint_path
from det_tasks.pytorch._loop.loop import FitOptions, TrialController
from det_tasks.pytorch._loop.profiler import ProfilerSettings
from det_tasks.pytorch._loop.warm_start import warm_start_reference
from det_tasks.sinks import InMemoryMetricsSink, MetricsSink

__all__ = [
    "FitResult",
    "Trainer",
    "detect_distributed",
    "init",
    "length_to_unit",
    "store_from_config",
    "trial_controller",
]

_POLICIES = ("best", "all", "none")


def init(
    *,
    hparams: dict[str, Any] | None = None,
    exp_conf: dict[str, Any] | None = None,
    distributed: DistributedContext | None = None,
    aggregation_frequency: int | None = None,
    enable_tensorboard_logging: bool = True,
    metrics_sink: MetricsSink | None = None,
    checkpoint_store: CheckpointStore | None = None,
    device: str | None = None,
    seed: int | None = None,
    model_dir: str | Path | None = None,
    trial_id: int | str = "local",
    experiment_id: int | str = "local",
) -> PyTorchTrialContext:
    """A PyTorchTrialContext for local or launched training; also usable as ``with init():``.

    ``aggregation_frequency`` and ``seed`` default to the experiment config's values
    (``optimizations.aggregation_frequency``, ``reproducibility.experiment_seed``)."""
    services = run_services.resolved()  # None off the platform: local sink and store
    info = services.cluster_info if services is not None else None
    tensorboard_dir = services.tensorboard_dir if services is not None else None
    if services is not None:
        metrics_sink = metrics_sink or services.metrics_sink
        checkpoint_store = checkpoint_store or services.checkpoint_store
    if info is not None:
        exp_conf = exp_conf if exp_conf is not None else info.trial.config
        hparams = hparams if hparams is not None else info.trial.hparams
        seed = seed if seed is not None else info.trial.trial_seed
        trial_id, experiment_id = info.trial.trial_id, info.trial.experiment_id
        model_dir = model_dir if model_dir is not None else (info.model_dir or None)
        if checkpoint_store is None:
            checkpoint_store = LocalDirectoryStore(info.checkpoint_dir)
    conf = dict(exp_conf or {})
    optimizations = conf.get("optimizations") or {}
    agg = _aggregation_frequency(aggregation_frequency, optimizations)
    seed, hparams = _seeded(conf, seed, hparams)
    settings = TrialSettings(
        hparams=dict(hparams),
        exp_conf=conf or None,
        aggregation_frequency=agg,
        average_aggregated_gradients=optimizations.get("average_aggregated_gradients", True),
        average_training_metrics=optimizations.get("average_training_metrics", True),
        seed=seed,
        trial_id=trial_id,
        experiment_id=experiment_id,
        device=device,
        model_dir=Path(model_dir) if model_dir is not None else None,
        enable_tensorboard_logging=enable_tensorboard_logging,
        tensorboard_path=Path(tensorboard_dir) if tensorboard_dir else None,
        nonfinite_loss=str(optimizations.get("nonfinite_loss", "warn")),
    )
    return PyTorchTrialContext(
        settings,
        distributed or detect_distributed(optimizations),
        metrics_sink=metrics_sink or InMemoryMetricsSink(),
        checkpoint_store=checkpoint_store,
        trainer=Trainer,
        checkpoint_loader=load_trial_from_checkpoint_path,
    )


def _aggregation_frequency(passed: int | None, optimizations: dict[str, Any]) -> int:
    """init()'s ``aggregation_frequency``, else the config's; both given must agree."""
    conf_agg = optimizations.get("aggregation_frequency")
    if passed is not None and conf_agg is not None and passed != conf_agg:
        raise ConfigError(
            f"aggregation_frequency={passed} was passed to init() but the "
            f"experiment config says optimizations.aggregation_frequency={conf_agg}; give one"
        )
    agg = passed if passed is not None else (conf_agg or 1)
    if isinstance(agg, bool) or not isinstance(agg, int) or agg < 1:
        raise ConfigError(f"aggregation_frequency must be an int >= 1, got {agg!r}")
    return agg


def _seeded(
    conf: dict[str, Any], seed: int | None, hparams: dict[str, Any] | None
) -> tuple[int, dict[str, Any]]:
    """The trial's seed (the config's experiment_seed when not given) and hparams (sampled
    from the config with it when not given), after seeding Python, numpy and torch."""
    if seed is None:
        seed = int((conf.get("reproducibility") or {}).get("experiment_seed", 0))
    if hparams is None:
        hparams = _hparams_from_config(conf, seed)
    _seed_everything(seed)
    return seed, hparams


def _hparams_from_config(conf: dict[str, Any], seed: int) -> dict[str, Any]:
    raw = conf.get("hyperparameters")
    if not raw:
        return {}
    from det_tasks.config.hyperparameters import parse_hyperparameters

    try:
        space = parse_hyperparameters(raw)
    except ValueError as err:
        raise ConfigError(f"exp_conf: {err}") from None
    return sample_hparams(space, random.Random(seed))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def detect_distributed(optimizations: dict[str, Any]) -> DistributedContext:
    """torchrun and horovodrun describe the worker group in the environment."""
    if int(os.environ.get("HOROVOD_SIZE", "1")) > 1:
        for name, value in horovod_tuning_env(optimizations).items():
            os.environ.setdefault(name, value)  # read by hvd.init(); the user's env wins
        try:
            import horovod.torch as hvd
        except ImportError:
            raise ConfigError(
                "this process was started by horovodrun but horovod is not installed: "
                "`make horovod` (or pip install '.[horovod]')"
            ) from None
        hvd.init()
        return DistributedContext.from_horovod(hvd)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return DistributedContext.from_torch_distributed()
    return DistributedContext()


def length_to_unit(
    length: Length, global_batch_size: int | None, records_per_epoch: int | None = None
) -> TrainUnit:
    """A config Length as the Batch or Epoch the loop counts, by the one rule in
    det_tasks.config.lengths (records_per_epoch turns epochs into batches)."""
    counted = in_batches_or_epochs(length, global_batch_size, records_per_epoch)
    return Epoch(counted.value) if counted.unit == "epochs" else Batch(counted.value)


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What fit() leaves behind: position, latest checkpoint and last validation metrics."""

    batches_trained: int
    checkpoint_uuid: str | None
    checkpoint_uri: str | None
    validation_metrics: dict[str, Any] | None
    best_metric: float | None


class Trainer:
    """``Trainer(trial, context).fit(...)``: train a PyTorchTrial in this process."""

    def __init__(self, trial: Any, context: PyTorchTrialContext) -> None:
        if not isinstance(context, PyTorchTrialContext):
            raise TypeError(f"Trainer needs the PyTorchTrialContext from init(), got {context!r}")
        if not hasattr(trial, "train_batch"):
            raise TrialError(
                f"{type(trial).__name__} is not a PyTorchTrial: it has no train_batch()"
            )
        self._trial = adapt_trial(trial, context)
        self._context = context
        self._profiling: ProfilerSettings | None = None

    def configure_profiler(
        self,
        sync_timings: bool = True,
        enabled: bool = False,
        begin_on_batch: int = 0,
        end_after_batch: int | None = None,
    ) -> None:
        """Time each phase of batches [begin_on_batch, end_after_batch] and report means."""
        self._profiling = ProfilerSettings(enabled, begin_on_batch, end_after_batch, sync_timings)

    def fit(
        self,
        checkpoint_period: TrainUnit | None = None,
        validation_period: TrainUnit | None = None,
        max_length: TrainUnit | None = None,
        reporting_period: TrainUnit = Batch(100),  # noqa: B008 - immutable, as Determined
        checkpoint_policy: str = "best",
        latest_checkpoint: str | None = None,
        step_zero_validation: bool = False,
        test_mode: bool = False,
        profiling_enabled: bool = False,
    ) -> FitResult:
        """Train to ``max_length``, validating/checkpointing at their periods, then stop.

        ``profiling_enabled`` profiles the whole run (phase timings and system figures,
        reported at the end) unless ``configure_profiler`` or the config's ``profiling``
        section chose a window.
        """
        controller = trial_controller(
            self,
            checkpoint_period=checkpoint_period,
            validation_period=validation_period,
            max_length=max_length,
            reporting_period=reporting_period,
            checkpoint_policy=checkpoint_policy,
            latest_checkpoint=latest_checkpoint,
            step_zero_validation=step_zero_validation,
            test_mode=test_mode,
            profiling_enabled=profiling_enabled,
        )
        controller.run()
        uuid = controller.latest_checkpoint_uuid
        store = controller.store
        return FitResult(
            batches_trained=controller.batches_trained,
            checkpoint_uuid=uuid,
            checkpoint_uri=store.uri(uuid) if uuid and not os.path.isdir(uuid) else uuid,
            validation_metrics=controller.latest_validation,
            best_metric=controller.best_metric,
        )


def trial_controller(
    trainer: Trainer,
    checkpoint_period: TrainUnit | None = None,
    validation_period: TrainUnit | None = None,
    max_length: TrainUnit | None = None,
    reporting_period: TrainUnit = Batch(100),  # noqa: B008 - immutable, as Determined
    checkpoint_policy: str = "best",
    latest_checkpoint: str | None = None,
    step_zero_validation: bool = False,
    test_mode: bool = False,
    profiling_enabled: bool = False,
) -> TrialController:
    """``trainer.fit()``'s arguments checked into the loop that runs them: fit() runs it to
    the end; a held trial (det_tasks.runner.held) drives it step by step instead."""
    ctx = trainer._context
    conf = ctx._settings.exp_conf or {}
    searcher = conf.get("searcher") or {}
    info = cluster_info.get_cluster_info()
    if info is not None and info.test_mode:
        test_mode = True  # `det-tasks run --test` of a script
    options = FitOptions(
        max_length=_resolve_max_length(max_length, conf, info),
        checkpoint_period=_unit_or_none("checkpoint_period", checkpoint_period),
        validation_period=_unit_or_none("validation_period", validation_period),
        reporting_period=_unit_or_none("reporting_period", reporting_period) or Batch(100),
        checkpoint_policy=_check_policy(checkpoint_policy),
        latest_checkpoint=latest_checkpoint,
        step_zero_validation=bool(step_zero_validation),
        test_mode=bool(test_mode),
        searcher_metric=searcher.get("metric"),
        smaller_is_better=bool(searcher.get("smaller_is_better", True)),
        profiling=trainer._profiling
        or _profiling_from_config(conf)
        or (ProfilerSettings(enabled=True) if profiling_enabled else None),
    )
    if options.checkpoint_policy == "best" and options.searcher_metric is None:
        warnings.warn(
            "checkpoint_policy='best' needs searcher.metric in the experiment config to "
            "rank validations; without it no checkpoint is taken after validation (only "
            "at checkpoint_period and at the end). Pass exp_conf with searcher.metric, or "
            "use checkpoint_policy='all'",
            UserWarning,
            stacklevel=3,
        )
    store = ctx._checkpoint_store or store_from_config(conf)
    ctx._checkpoint_store = store
    if latest_checkpoint is None and not ctx._warm_started:
        # Once per trial: a later fit() on the same context continues, not restarts.
        options = dataclasses.replace(options, warm_start=warm_start_reference(conf, store))
        ctx._warm_started = True
    sink = ctx._metrics_sink or InMemoryMetricsSink()
    return TrialController(trainer._trial, ctx, options, sink, store)


def _resolve_max_length(
    max_length: TrainUnit | None, conf: dict[str, Any], info: cluster_info.ClusterInfo | None
) -> TrainUnit:
    if max_length is not None:
        unit = _unit_or_none("max_length", max_length)
        assert unit is not None
        if not isinstance(unit.value, int):
            raise ValueError(f"max_length must be a single count, got {unit!r}")
    governing = _searcher_length(info)
    if governing is not None:
        # Under a searcher (`det-tasks run`, a flow's segment, an ASHA rung) its length
        # governs, as Determined ignores max_length on a cluster.
        if max_length is not None and max_length != governing:
            warnings.warn(
                f"fit(max_length={max_length!r}) is overridden by the searcher's length "
                f"{governing!r} (searcher.max_length, an ASHA rung or --max-batches)",
                UserWarning,
                stacklevel=3,
            )
        return governing
    if max_length is not None:
        return max_length
    if conf.get("searcher"):
        # exp_conf given to init() by hand is an entry: the loader's path, with its
        # deprecations, unhonoured-field warnings and one-line errors (det_tasks.config).
        config = parse_config(conf, source="exp_conf")
    if conf.get("searcher") and config.has_max_length:
        gbs = conf.get("hyperparameters", {}).get("global_batch_size")
        return length_to_unit(config.max_length, gbs, config.records_per_epoch)
    raise ValueError(
        "fit() needs max_length for local training, e.g. max_length=pytorch.Epoch(1) or "
        "pytorch.Batch(1000) (or pass exp_conf with searcher.max_length to init())"
    )


def _searcher_length(info: cluster_info.ClusterInfo | None) -> TrainUnit | None:
    length = info.searcher_length if info is not None else None
    if not length:
        return None
    ((unit, value),) = length.items()
    return Epoch(value) if unit == "epochs" else Batch(value)


def _unit_or_none(name: str, value: Any) -> TrainUnit | None:
    if value is None or isinstance(value, TrainUnit):
        return value
    raise TypeError(
        f"{name} must be a pytorch.Batch or pytorch.Epoch (e.g. pytorch.Batch({value!r})), "
        f"got {type(value).__name__}"
    )


def _check_policy(policy: str) -> str:
    if policy in _POLICIES:
        return policy
    close = difflib.get_close_matches(str(policy), _POLICIES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"checkpoint_policy must be one of {', '.join(_POLICIES)}, got {policy!r}{hint}"
    )


def _profiling_from_config(conf: dict[str, Any]) -> ProfilerSettings | None:
    profiling = conf.get("profiling") or {}
    if not profiling.get("enabled"):
        return None
    return ProfilerSettings(
        enabled=True,
        begin_on_batch=int(profiling.get("begin_on_batch", 0)),
        end_after_batch=profiling.get("end_after_batch"),
        sync_timings=bool(profiling.get("sync_timings", True)),
    )
