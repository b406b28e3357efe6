"""Training one trial in this process from an experiment config (``det-tasks run``)."""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from det_tasks import cluster_info, run_services
from det_tasks.checkpoints.references import scheme_of
from det_tasks.checkpoints.retention import collect_garbage
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.config import ExperimentConfig
from det_tasks.config.entered import EnteredConfig
from det_tasks.errors import ConfigError, DetTasksError, InvalidHP
from det_tasks.pytorch import Batch, Epoch, Trainer, TrainUnit, init
from det_tasks.runner import stop_requests, worker_group
from det_tasks.runner.determined_launch_layers import parse_launch_layer
from det_tasks.runner.entrypoint import (
    import_failure,
    load_trial_class,
    model_dir_on_path,
    parse_script_command,
)
from det_tasks.runner.progress import ProgressSink
from det_tasks.runner.resume import choose_resume_checkpoint
from det_tasks.runner.stop_signals import StopSignals
from det_tasks.runner.trial_config import with_defaults
from det_tasks.runner.trial_setup import (
    checkpoint_store_for,
    fit_periods,
    load_raw_config,
    platform_services,
    resolved_model_dir,
    train_unit,
    trial_hparams,
)
from det_tasks.runner.workdir import in_model_dir
from det_tasks.sinks import InMemoryMetricsSink, MetricsSink, MultiSink

__all__ = ["RunResult", "check_entrypoint", "load_entrypoint", "run_trial"]


@dataclasses.dataclass(frozen=True)
class RunResult:
    hparams: dict[str, Any]
    batches_trained: int
    checkpoint_uuid: str | None
    checkpoint_uri: str | None
    validation_metrics: dict[str, Any] | None
    sink: InMemoryMetricsSink
    run_url: str | None = None  # the MLflow page of the trial run, when there is one


def run_trial(
    config_path: str | Path,
    model_dir: str | Path | None = None,
    *,
    overrides: list[str] | None = None,
    test_mode: bool = False,
    checkpoint_dir: str | Path | None = None,
    latest_checkpoint: str | Sequence[str] | None = None,
    device: str | None = None,
    progress: bool = True,
    extra_sink: MetricsSink | None = None,
    hparams: dict[str, Any] | None = None,
    max_batches: int | None = None,
    trial_id: str = "1",
    experiment_run_key: str | None = None,
    stop_signals: StopSignals | None = None,
    experiment_best: float | None = None,
    entered: EnteredConfig | None = None,
) -> RunResult:
    """Validate the config, build the trial from its entrypoint, and fit it. ``latest_checkpoint``
    may list several checkpoints, newest first: training resumes from the first intact one (the
    others are fallbacks for a corrupted newest one). ``entered``: the config as its starter
    entered it (overrides applied): neither the file nor ``overrides`` is read again."""
    config_path = Path(config_path)
    model_dir = resolved_model_dir(Path(model_dir) if model_dir is not None else config_path.parent)
    raw, config = entered if entered is not None else load_raw_config(config_path, overrides)
    _check_one_process(config)
    if worker_group.worker_rank() != 0:  # only the chief logs to MLflow and writes checkpoints
        progress = False
        checkpoint_dir = checkpoint_dir or tempfile.mkdtemp(prefix="det-tasks-rank-")
    hparams = trial_hparams(config, hparams)
    gbs = hparams.get("global_batch_size")
    max_length = _max_length(config, max_batches, gbs)
    with model_dir_on_path(model_dir):
        # The entrypoint loads before any MLflow run exists: a wrong class or script name
        # leaves nothing behind.
        with in_model_dir(model_dir):
            entry = load_entrypoint(config, model_dir)
        platform = platform_services(
            raw, config, hparams, model_dir, config_path, checkpoint_dir, trial_id,
            experiment_run_key,
        )  # fmt: skip
        with platform as services:
            store = checkpoint_store_for(services, raw, checkpoint_dir, config)
            memory = InMemoryMetricsSink()
            bar = (1 if test_mode else _batches(max_length), int(gbs or 1)) if progress else None
            sink = _sinks(memory, services, bar, extra_sink)
            latest = _absolute_if_path(choose_resume_checkpoint(store, latest_checkpoint))
            run = _RunInputs(config, raw, hparams, model_dir, store, sink, latest, device, trial_id)
            # SIGHUP, SIGTERM; the search's best so far (a script's get_experiment_best...)
            run = dataclasses.replace(
                run, stop_signals=stop_signals, experiment_best=experiment_best
            )
            result = _train(run, entry, services, max_length, test_mode)
            if services is None:
                _apply_retention(config, store, memory)
            uri = store.uri(result[1]) if result[1] else None
            url = services.run_url if services is not None else None
        return RunResult(hparams, result[0], result[1], uri, result[2], memory, url)


def _check_one_process(config: ExperimentConfig) -> None:
    if config.resources.slots_per_trial > 1 and not worker_group.inside_worker_group():
        raise ConfigError(
            f"resources.slots_per_trial={config.resources.slots_per_trial}: run_trial() trains "
            "in this one process; use `det-tasks run`, which starts the workers with "
            "torchrun/horovodrun, or set resources.slots_per_trial: 1"
        )


def _max_length(config: ExperimentConfig, max_batches: int | None, gbs: Any) -> TrainUnit | None:
    """``--max-batches`` when given, else the searcher's length (None: a script decides)."""
    if max_batches:
        return Batch(max_batches)
    return train_unit(config, config.max_length, gbs) if config.has_max_length else None


def _train(
    run: _RunInputs,
    entry: type | Path,
    services: Any,
    max_length: TrainUnit | None,
    test_mode: bool,
) -> tuple[int, str | None, dict[str, Any] | None]:
    """Run the script or fit the trial class, with the services provided, in the model
    directory; the sink is closed (flushed) whatever happens."""
    try:
        with run_services.provide(services), in_model_dir(run.model_dir):
            if isinstance(entry, Path):
                return _run_script(run, entry, max_length, test_mode)
            assert max_length is not None  # the config requires one for a class
            return _fit_trial_class(run, entry, max_length, test_mode)
    finally:
        run.sink.close()


def _batches(length: TrainUnit | None) -> int | None:
    """A length's batch count, for the progress bar (None: in epochs, or none)."""
    return length.value if isinstance(length, Batch) and isinstance(length.value, int) else None


def _sinks(
    memory: InMemoryMetricsSink,
    services: Any,
    progress: tuple[int | None, int] | None,
    extra: MetricsSink | None,
) -> MultiSink:
    """Where the trial's metrics go: memory (the result), the platform's sink, the progress
    bar (its total batches and the global batch size), and the caller's own."""
    sinks: list[MetricsSink] = [memory]
    if services is not None:
        sinks.append(services.metrics_sink)
    if progress is not None:
        sinks.append(ProgressSink(*progress))
    if extra is not None:
        sinks.append(extra)
    return MultiSink(*sinks)


@dataclasses.dataclass(frozen=True)
class _RunInputs:
    config: ExperimentConfig
    raw: dict[str, Any]
    hparams: dict[str, Any]
    model_dir: Path
    store: CheckpointStore
    sink: MetricsSink
    latest: str | None
    device: str | None
    trial_id: str
    # A trial class stops at a batch boundary on them, with a checkpoint, and raises their
    # SignalStop (its run then ends KILLED with det.state PAUSED).
    stop_signals: StopSignals | None = None
    experiment_best: float | None = None


def load_entrypoint(config: ExperimentConfig, model_dir: Path) -> type | Path:
    """The trial class (``module:Class``) or the script's path; inside model_dir_on_path."""
    if config.is_trial_class_entrypoint:
        assert isinstance(config.entrypoint, str)
        return load_trial_class(config.entrypoint, model_dir)
    launched_trial = parse_launch_layer(config.entrypoint).trial
    if launched_trial is not None:  # `python3 -m determined.launch.X --trial model_def:Trial`
        return load_trial_class(launched_trial, model_dir)
    script, _ = parse_script_command(config.entrypoint)
    path = (model_dir / script).resolve()
    if not path.is_file():
        raise ConfigError(f"entrypoint script {str(script)!r} not found in {str(model_dir)!r}")
    return path


def check_entrypoint(config: ExperimentConfig, model_dir: Path) -> type | Path:
    """Load the entrypoint as a trial's worker will (``det-tasks check-config`` does the
    same), so a missing module or a class that is not a trial is reported before anything
    starts. An exception raised while importing the user's module becomes one TrialError
    naming the entrypoint, the error and the user's line."""
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    with model_dir_on_path(model_dir), in_model_dir(model_dir):
        try:
            return load_entrypoint(config, model_dir)
        except DetTasksError:
            raise
        except Exception as err:
            raise import_failure(config.entrypoint, err, model_dir) from None


def _absolute_if_path(reference: str | None) -> str | None:
    """A checkpoint given as a relative path, made absolute: the trial's code (which loads
    it) runs in the model directory."""
    if reference is not None and scheme_of(reference) is None and os.path.exists(reference):
        return os.path.abspath(reference)
    return reference


def _trial_number(trial_id: str) -> int | str:
    """Determined's trial ids are ints; the flows' are numbers passed as text."""
    return int(trial_id) if trial_id.isdigit() else trial_id


def _fit_trial_class(
    run: _RunInputs, trial_class: type, max_length: TrainUnit, test_mode: bool
) -> tuple[int, str | None, dict[str, Any] | None]:
    config = run.config
    with init(
        hparams=run.hparams,
        exp_conf=with_defaults(run.raw, config),
        metrics_sink=run.sink,
        checkpoint_store=run.store,
        device=run.device,
        seed=config.reproducibility.experiment_seed,
        model_dir=run.model_dir,
        trial_id=_trial_number(run.trial_id),
    ) as context:
        if run.stop_signals is not None:
            run.stop_signals.watch(context)
        trial = trial_class(context)
        trainer = Trainer(trial, context)
        result = trainer.fit(
            max_length=max_length,
            latest_checkpoint=run.latest,
            test_mode=test_mode,
            **fit_periods(config, run.hparams),
        )
    if run.stop_signals is not None:
        run.stop_signals.raise_if_stopped(result.batches_trained, result.checkpoint_uri)
    return result.batches_trained, result.checkpoint_uuid, result.validation_metrics


def _run_script(
    run: _RunInputs, path: Path, max_length: TrainUnit | None = None, test_mode: bool = False
) -> tuple[int, str | None, dict[str, Any] | None]:
    """A Trainer-API script, run in this process as ``__main__`` with cluster info set.

    ``max_length`` (the searcher's length, a rung's or ``--max-batches``) and ``test_mode``
    travel in the cluster info and override the script's own fit() arguments."""
    from det_tasks import compat

    _, args = parse_script_command(run.config.entrypoint)
    compat.install()
    info = cluster_info.ClusterInfo(
        trial=cluster_info.TrialInfo(
            trial_id=_trial_number(run.trial_id),
            experiment_id="local",
            hparams=run.hparams,
            config=with_defaults(run.raw, run.config),
            trial_seed=run.config.reproducibility.experiment_seed,
        ),
        latest_checkpoint=run.latest,
        checkpoint_dir=str(getattr(run.store, "root", "checkpoints")),
        model_dir=str(run.model_dir.resolve()),
        searcher_length=_length_dict(max_length),
        test_mode=test_mode,
        experiment_best=run.experiment_best,
    )
    memory = next(
        s for s in getattr(run.sink, "sinks", [run.sink]) if isinstance(s, InMemoryMetricsSink)
    )
    services = _script_services(run, info)
    old_argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        with (
            cluster_info.launched(info),
            run_services.provide(services),
            stop_requests.passed_to(services.control),
        ):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                if exit_.code not in (0, None):
                    raise
    finally:
        sys.argv = old_argv
    steps = memory.checkpoints[-1].steps_completed if memory.checkpoints else 0
    uuid = memory.checkpoints[-1].uuid if memory.checkpoints else None
    validation = memory.validation[-1][1] if memory.validation else None
    if services.control.claimed:  # a Core API script: it answered stop requests itself
        _settle_core_script(run, services, max_length)
        reference = run.store.uri(uuid) if uuid else None
        # Stopped only if it acknowledged the request (should_preempt() returned True to
        # it): one that ran on to its end has finished, as in Determined.
        if run.stop_signals is not None and services.control.acknowledged:
            run.stop_signals.raise_if_stopped(steps, reference)
        if services.control.acknowledged:
            stop_requests.raise_if_requested(services.control, steps, reference)
    return steps, uuid, validation


def _script_services(run: _RunInputs, info: cluster_info.ClusterInfo) -> run_services.RunServices:
    """The script's one services object: the run's sink and store, the platform's TensorBoard
    folder and page, the searcher's length, and a control whose stop requests reach a Core
    API script (once ``core.init()`` claims it, SIGTERM/SIGHUP stop it at its own boundary)."""
    outer = run_services.current_services()
    signals = run.stop_signals
    return run_services.RunServices(
        metrics_sink=run.sink,
        checkpoint_store=run.store,
        tensorboard_dir=outer.tensorboard_dir if outer else None,
        run_url=outer.run_url if outer else None,
        control=run_services.TrialControl(on_claim=signals.watch if signals else None),
        searcher_length=info.searcher_length,
        cluster_info=info,
    )


def _settle_core_script(
    run: _RunInputs, services: run_services.RunServices, max_length: TrainUnit | None
) -> None:
    """After a Core API script returned: an invalid-hyperparameter exit goes to the
    searcher; otherwise tell the platform how far it got of its length (a script that
    returns without a stop request and without a length in batches has finished)."""
    control = services.control
    if control.early_exit == "EXITED_REASON_INVALID_HP":
        raise InvalidHP("the script reported an early exit: invalid hyperparameters")
    trained = control.steps_completed
    stopped = control.acknowledged
    value = max_length.value if isinstance(max_length, Batch) else None
    batches = value if isinstance(value, int) else None
    length = batches if stopped else trained  # returned unasked: finished, as in Determined
    services.record_position(
        trained, length, control.early_exit == "EXITED_REASON_USER_REQUESTED_STOP"
    )


def _length_dict(length: TrainUnit | None) -> dict[str, int] | None:
    if length is None:
        return None
    assert isinstance(length.value, int)
    return {"epochs" if isinstance(length, Epoch) else "batches": length.value}


def _apply_retention(
    config: ExperimentConfig, store: CheckpointStore, memory: InMemoryMetricsSink
) -> None:
    storage = config.checkpoint_storage
    if storage is None or not memory.checkpoints:
        return
    collect_garbage(
        store,
        memory.checkpoints,
        storage.save_trial_latest,
        storage.save_trial_best,
        config.searcher.metric,
        config.searcher.smaller_is_better,
    )
