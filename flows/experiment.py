"""The ``experiment`` flow: validate a config, expand its searcher into trials, and run each
trial as a chain of train -> validate -> checkpoint segments (Prefect tasks), at most
``max_concurrent_trials`` at once. ``prefect deployment run experiment/const`` starts it.

Run without a server: ``python -m flows.experiment examples/mnist/const.yaml``.
"""

# ruff: noqa: E402 -- `python -m flows.experiment` starts Prefect's server (_prestart) before
# the heavy imports below, so the two start-ups overlap.
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from flows.command_line import CommandLine, check_command_line
from flows.embedded import (
    EmbeddedPrefectServer,
    WarmServices,
    attach_warm_services,
    prefect_database_ready,
)


def _prestart(
    argv: list[str],
) -> tuple[CommandLine | None, EmbeddedPrefectServer | None, WarmServices | None]:
    """With valid input, use the home's warm services (infra.warm_home) where they answer,
    else start Prefect's server now, in its own process, while this module imports Prefect,
    MLflow and Dask; the checked command line goes to main, which does not check it again.
    With bad input start nothing (main says what is wrong, and nothing was created).

    In a home whose Prefect database is ready and that has no warm services, the server
    starts before the command line is checked: that check imports the user's trial (and
    torch), ~2 s the server's start would otherwise wait for. Bad input then stops it; it
    created nothing."""
    from det_tasks.errors import DetTasksError
    from det_tasks.home import warm_record

    if not argv or argv[0] in ("-h", "--help"):
        return None, None, None
    memory = os.environ.get("DET_TASKS_WORKER_MEMORY_MB", "512")  # engine.worker_memory_mb
    if not memory.isdigit() or int(memory) <= 0:
        return None, None, None
    early = None
    if not warm_record() and prefect_database_ready():
        early = EmbeddedPrefectServer.start()
    try:
        checked = check_command_line(argv)
    except (DetTasksError, ValueError):
        if early is not None:
            early.stop()
            os.environ.pop("PREFECT_API_URL", None)
        return None, None, None
    if early is not None:
        return checked, early, None
    warm = attach_warm_services(checked.cfg.resources.slots_per_trial)
    if warm is not None:
        return checked, None, warm
    return checked, EmbeddedPrefectServer.start(), None


_CHECKED, _PRESTARTED, _WARM = (
    _prestart(sys.argv[1:]) if __name__ == "__main__" else (None, None, None)
)

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort
from prefect.flow_runs import suspend_flow_run
from prefect.runtime import flow_run
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    Settings,
    temporary_settings,
)
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner

from cluster.environment import SCHEDULER_ENV
from det_tasks.config import ExperimentConfig
from det_tasks.config.experiment_name import named
from det_tasks.errors import ConfigError, DetTasksError, StepFailed
from det_tasks.home import det_tasks_home
from det_tasks.searchers.base import Searcher, Work
from det_tasks.searchers.choose import make_searcher, trials_at_once
from flows.embedded import (
    honour_checkpoint_folder,
    start_shielded_prefect_server,
    use_embedded_defaults,
)
from flows.job_seat import queued_chains
from flows.lifecycle import continue_lines
from flows.log_delivery import logs_delivered
from flows.quiet_shutdown import exit_without_final_collection, quiet_prefect_shutdown
from registry.runs.experiment_setup import mlflow_link
from registry.servers.settings import RegistrySettings

# torch, MLflow, Dask and boto3 (~3 s of imports) load where the flow uses them: Prefect's
# engine imports this module before it sets the flow run Running, and `prefect deploy`
# imports it for the flow's parameters.
if TYPE_CHECKING:
    from cluster.placement import Placement
    from flows.chains import TrialChains
    from flows.stopping import StopControl
    from flows.trial_table import TrialTable
    from registry.runs.tracking import ExperimentRuns

__all__ = ["experiment", "run_settings"]


def _expected_trials(cfg: ExperimentConfig, known: int) -> int:
    """How many trials the searcher will run: ``max_trials`` for those that propose trials
    as others finish (random, adaptive_asha, plug-ins: their first proposals are fewer),
    else the trials known now (single, grid)."""
    if cfg.searcher.name not in ("single", "grid") and cfg.searcher.max_trials:
        return max(known, cfg.searcher.max_trials)
    return known


def _after_earlier_runs(
    mlflow: Any, runs: ExperimentRuns, run_key: str, config_path: Path, overrides: list[str]
) -> None:
    """End the runs whose flow stopped without a word, and say how an earlier experiment of
    this name continues (a relaunch starts afresh, as Determined's create does)."""
    from flows.activation_start import has_deployment
    from registry.runs.run_states import end_orphans

    logger = get_run_logger()
    for orphan in end_orphans(mlflow, [runs.experiment_id]):
        logger.warning("ended MLflow run %s: its flow stopped without a word", orphan)
    command = None if has_deployment() else (config_path, overrides)
    for line in continue_lines(mlflow, runs.experiment_id, run_key, command):
        logger.warning(line)


def _searcher_work(
    cfg: ExperimentConfig, runs: ExperimentRuns
) -> tuple[Searcher, set[int], list[Work]]:
    """The searcher (its saved state restored), the trials it has finished, and the work
    to start: a finished trial's final segment is not run again."""
    from flows.chains import final_segment

    searcher = make_searcher(cfg)
    _restore(searcher, runs)
    finished = searcher.finished()
    todo = [w for w in searcher.start() if w.trial_id not in finished or not final_segment(w, cfg)]
    return searcher, finished, todo


def _restore(searcher: Searcher, runs: ExperimentRuns) -> None:
    from registry.runs.searcher_state import load_searcher_state

    state = load_searcher_state(runs.client.get_run(runs.parent_run_id).data.tags)
    if state is not None:
        searcher.load(state)


# Threads only wait on Dask futures; enough for every running trial's task.
@flow(name="experiment", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=64))  # type: ignore[arg-type]
def experiment(
    config: str = "examples/mnist/const.yaml",
    overrides: list[str] | None = None,
    model_dir: str | None = None,
    package: str | None = None,
    config_yaml: str | None = None,
    experiment_key: str | None = None,
    use_changed_code: bool = False,
) -> Any:
    """Run every trial the config's searcher proposes; returns the best trial's summary
    (or, when stopped on request, a Cancelled state or the flow run's suspension).

    ``package`` (an ``s3://.../packages/<sha256>.tar.gz`` from ``det-tasks experiment
    create``) is unpacked into a fresh folder on this worker; the config is ``config_yaml``
    when given (``config`` then only names it), else the file ``config`` inside the package.
    ``experiment_key``: continue that experiment (its MLflow runs, trials and searcher
    state) instead of starting one keyed by this flow run's id. Without a package the
    experiment runs its code snapshot (registry.experiments.code), taken when it was created;
    ``use_changed_code``: resume with the model folder's code instead, as a new code version.
    """
    from registry.experiments.packages import fetch_package

    with logs_delivered():  # the last task's line is on the server before Completed
        logger = get_run_logger()
        overrides = list(overrides or [])
        if not package:
            config_path = Path(config).resolve()
            model_path = Path(model_dir).resolve() if model_dir else config_path.parent
            return _run_experiment(
                config_path, model_path, overrides, None, experiment_key, use_changed_code
            )
        model_path = fetch_package(package)
        logger.info("model package %s unpacked into %s", package, model_path)
        config_path = (model_path / config).resolve()
        if config_yaml is not None:
            config_path = model_path.parent / Path(config).name
            config_path.write_text(config_yaml, encoding="utf-8")
        try:
            if not config_path.is_relative_to(model_path.parent.resolve()):
                raise ConfigError(
                    f"config {config!r} is outside the model package: give a path in it"
                )
            return _run_experiment(config_path, model_path, overrides, package, experiment_key)
        finally:
            shutil.rmtree(model_path.parent, ignore_errors=True)


def _run_experiment(
    config_path: Path,
    model_path: Path,
    overrides: list[str],
    package: str | None = None,
    experiment_key: str | None = None,
    use_changed_code: bool = False,
) -> Any:
    from det_tasks.config.entered import enter_file
    from flows.activation_start import activation_settled, code_for, reenter
    from flows.chains import TrialChains
    from registry.experiments.activation import check_activatable
    from registry.runs.tracking import ExperimentRuns, client_for

    logger = get_run_logger()
    # Fails fast, naming the field; entered once (a command line checked it already).
    raw, cfg = enter_file(config_path, overrides)
    settings, tracking_uri = _tracking_settings()
    # Named here once; the name travels to the workers with the overrides they get (a
    # worker's copy of the config has a file name of its own). ``overrides``: as typed.
    raw, cfg, carried = named(raw, cfg, config_path, overrides)
    name = str(cfg.name)
    run_key = experiment_key or str(flow_run.get_id() or uuid.uuid4())
    mlflow = client_for(tracking_uri)
    if experiment_key:  # before a run exists: an unknown key must not start one
        check_activatable(mlflow, name, experiment_key, tracking_uri)
    model_path, code = code_for(mlflow, run_key, raw, cfg, model_path, package, use_changed_code)
    runs = ExperimentRuns(mlflow, name, run_key, raw)
    _after_earlier_runs(mlflow, runs, run_key, config_path, overrides)
    before, activated = reenter(runs, code)
    searcher, finished, todo = _searcher_work(cfg, runs)
    limit = trials_at_once(cfg)
    trial_count = _expected_trials(cfg, len({w.trial_id for w in todo} | finished))
    table = _trial_table(name, cfg, runs, settings, trial_count)
    started = time.monotonic()
    logger.info("experiment %r: %d trial(s) to start, at most %d at a time", name, len(todo), limit)
    logger.info("MLflow: %s", mlflow_link(tracking_uri, runs.experiment_id))
    chains = functools.partial(
        TrialChains, cfg, raw, runs, config_path, model_path, carried, run_key, package, table
    )
    with activation_settled(activated, runs, before, code, config_path, run_key):
        best, released, stop = _train(chains, searcher, todo, limit, cfg, runs, run_key, activated)
    if released:
        logger.info("released %d held trial(s)", released)
    table.publish()
    if stop.mode is not None:
        return _stopped(stop, runs, config_path, run_key)
    _finish(runs, settings)
    result = {
        "experiment": name,
        "searcher_metric": cfg.searcher.metric,
        # The table's best reads each trial's whole validation history (a validation
        # inside a train step is the best as often as the one ending it).
        "best": table.best() or best,
        "mlflow_experiment": mlflow_link(tracking_uri, runs.experiment_id),
        "mlflow_parent_run": mlflow_link(tracking_uri, runs.experiment_id, runs.parent_run_id),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    logger.info("summary: %s", json.dumps(result, default=str))
    return result


def _train(
    chains: Callable[[Placement], TrialChains],
    searcher: Searcher,
    todo: list[Work],
    limit: int,
    cfg: ExperimentConfig,
    runs: ExperimentRuns,
    run_key: str,
    activated: bool,
) -> tuple[Any, int, StopControl]:
    """Run the trials on the cluster until they end or a stop request stops them; returns
    the chains' best, how many held trials the final sweep released, and the stop."""
    from cluster.startup import dask_client
    from cluster.steps import release_everywhere
    from flows.disk_full import paused_for_room
    from flows.stopping import StopControl

    with dask_client(limit, gpu_slots=cfg.resources.slots_per_trial) as client:
        trials = queued_chains(chains, client, cfg, run_key, limit)
        stop = StopControl(client, run_key, runs.client, runs.parent_run_id, _prefect_cancelling)
        if activated:
            stop.clear()  # the request that paused it is spent
        try:
            with stop.signals_handled():
                best = trials.run(todo, searcher, limit, stop)
        except BaseException as err:  # a failure, or a second Ctrl-C: no run stays RUNNING
            if not paused_for_room(client, runs, run_key, trials.table, stop, err):
                _end_abruptly(client, runs, run_key, trials.table, err)
                raise
            best = None  # a full disk: paused, to continue once there is room
        finally:
            if trials.queue is not None:
                trials.queue.end(paused=stop.mode == "pause")
        # The trials' own releases first (a STOPPED trial's run ends FINISHED STOPPED): the
        # sweep after them ends whatever is still held, as COMPLETED or the stop's state,
        # and it overtook a release still queued (a trial ASHA stopped ended COMPLETED).
        trials.wait_releases()
        released = release_everywhere(client, run_key, stop.state)
        trials.settle_releases()  # a release that found its trial evicted
    return best, released, stop


def _tracking_settings() -> tuple[RegistrySettings, str]:
    """The registry's settings and its tracking URI, which a flow run must have."""
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise RuntimeError(
            "MLFLOW_TRACKING_URI is not set on this worker: start the stack (make up) and "
            "source .stack/env, or run without servers: python -m flows.experiment CONFIG"
        )
    return settings, settings.tracking_uri


def _trial_table(
    name: str, cfg: ExperimentConfig, runs: ExperimentRuns, settings: RegistrySettings, total: int
) -> TrialTable:
    from flows.trial_table import TrialTable, searcher_batches

    tracking_uri = settings.tracking_uri or ""
    return TrialTable(
        name,
        cfg.searcher.metric,
        cfg.searcher.smaller_is_better,
        lambda run_id: mlflow_link(tracking_uri, runs.experiment_id, run_id),
        total_trials=total,
        parent_run_id=runs.parent_run_id,
        client=runs.client,
        trial_batches=searcher_batches(cfg),  # progress in batches (one trial read 0%)
    )


def _finish(runs: ExperimentRuns, settings: RegistrySettings) -> None:
    """GC, the winner and the plots; if they fail, the parent run still ends (FAILED)."""
    from registry.jobs.trial_services import finish_experiment
    from registry.runs.run_states import end_running_runs, record_failure
    from registry.servers.s3 import LazyClient

    try:
        finish_experiment(runs, LazyClient(settings.s3_endpoint))
    except Exception as err:
        with contextlib.suppress(Exception):
            text = f"{type(err).__name__}: {err}"
            record_failure(runs.client, runs.experiment_id, runs.parent_run_id, text)
            end_running_runs(runs.client, runs.experiment_id, runs.parent_run_id, "ERROR", "FAILED")
        raise


def _prefect_cancelling() -> bool:
    """Whether Prefect is cancelling this flow run (its worker's SIGTERM), not a plain
    SIGTERM (a pause: checkpoint and continue later)."""
    run_id = flow_run.get_id()
    if not run_id:
        return False
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(str(run_id))).state
    return state is not None and state.type == StateType.CANCELLING


def _end_abruptly(
    client: Any, runs: ExperimentRuns, run_key: str, table: TrialTable, err: BaseException
) -> None:
    """The flow ends without its trials' cooperation: stop them at once on their workers,
    and end every run of the experiment (CANCELED on a second Ctrl-C, FAILED on an error)."""
    from cluster.steps import release_everywhere, stop_everywhere
    from registry.runs.run_states import end_running_runs, record_failure

    killed = isinstance(err, KeyboardInterrupt)
    state, status = ("CANCELED", "KILLED") if killed else ("ERROR", "FAILED")
    with contextlib.suppress(Exception):
        stop_everywhere(client, run_key, "kill")
        # With the state, a held trial's run ends as the others (None ended it FINISHED
        # COMPLETED under the FAILED parent, however far it had trained).
        release_everywhere(client, run_key, state)
    if not killed:
        text = str(err) if isinstance(err, StepFailed) else f"{type(err).__name__}: {err}"
        with contextlib.suppress(Exception):
            trial_id = err.trial_id if isinstance(err, StepFailed) else None
            record_failure(
                runs.client,
                runs.experiment_id,
                runs.parent_run_id,
                text,
                int(trial_id) if trial_id is not None and str(trial_id).isdigit() else None,
            )
    with contextlib.suppress(Exception):
        end_running_runs(runs.client, runs.experiment_id, runs.parent_run_id, state, status)
    with contextlib.suppress(Exception):
        table.publish()


def _stopped(stop: StopControl, runs: ExperimentRuns, config_path: Path, run_key: str) -> Any:
    """An experiment stopped on request: its runs end KILLED with its state, and the flow
    run is suspended (a deployment's: activate resumes it) or ends Cancelled."""
    from flows.activation_start import PAUSED_FOR_S, has_deployment
    from registry.runs.run_states import end_running_runs

    assert stop.state is not None
    end_running_runs(runs.client, runs.experiment_id, runs.parent_run_id, stop.state)
    short = run_key[:8]
    if stop.mode == "pause":
        if has_deployment():
            how = f"det experiment activate {short} (or Resume in the Prefect UI)"
            get_run_logger().warning("experiment %s paused; continue with: %s", short, how)
            suspend_flow_run(timeout=PAUSED_FOR_S, key=uuid.uuid4().hex)
        how = f"python -m flows.experiment {config_path} --activate {run_key}"
        why = f": {stop.why}," if stop.why else " (trials checkpointed);"
        message = f"experiment {short} paused{why} continue with: {how}"
    else:
        done = "killed (no checkpoint)" if stop.mode == "kill" else "canceled (trials checkpointed)"
        message = f"experiment {short} {done}: runs ended KILLED, det.state {stop.state}"
    get_run_logger().warning(message)
    if has_deployment():
        _end_cancelled(message)
    return Cancelled(message=message)


def _end_cancelled(message: str) -> NoReturn:
    """End this deployment run Cancelled with ``message``, without Prefect's traceback: a
    returned Cancelled state makes its engine raise CancelledRun once the flow returns,
    which a deployment run logs as a 30-line "Engine execution exited with unexpected
    exception" (prefect 3.8.8 flow_engine.run_flow). Abort carrying the state the run was
    set to is an ending the engine takes as decided: it logs "Finished in state
    Cancelled(...)" and the process exits 0."""
    with get_client(sync_client=True) as client:
        result: Any = client.set_flow_run_state(
            uuid.UUID(str(flow_run.get_id())), Cancelled(message=message), force=True
        )
    ended = Abort(message)
    ended.state = result.state  # type: ignore[attr-defined]  # read by the flow engine
    raise ended


# Determined's paused experiments wait for activate indefinitely; Prefect fails a suspended
# run when its timeout passes, so the timeout is a year.
def run_settings(prestarted_api: str | None) -> contextlib.AbstractContextManager[Settings]:
    """Prefect settings for one ``python -m flows.experiment`` run.

    - ``prestarted_api``: the API of the server this run prestarted. Prefect read its URL
      at import, and the server moves to another port when its first was taken meanwhile.
    - The ephemeral server's default 20 s start-up wait is too short on a busy machine.
    - When the server is the run's own (prestarted, or Prefect's ephemeral one: no API URL
      set), it ends with this process, so nothing would read the flow run's heartbeats,
      and their thread made every run's end wait up to 1 s (it sleeps in 1 s steps): they
      are off there, unless the user set their frequency."""
    updates: dict[Any, Any] = {PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 300}
    if prestarted_api is not None:
        updates[PREFECT_API_URL] = prestarted_api
    own_server = prestarted_api is not None or PREFECT_API_URL.value() is None
    no_heartbeat = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None} if own_server else {}
    return temporary_settings(updates, set_defaults=no_heartbeat)


def main(
    argv: list[str] | None = None,
    prestarted: EmbeddedPrefectServer | None = None,
    checked: CommandLine | None = None,
    warm: WarmServices | None = None,
) -> int:
    """``python -m flows.experiment CONFIG [key=value ...]``: one experiment, no servers
    needed (see flows.embedded); prints the summary as JSON. ``prestarted``: the Prefect
    server _prestart started for it; ``checked``: the command line it already checked;
    ``warm``: the home's warm services _prestart pointed it at."""
    from cluster.held_trials import TrialFailed
    from cluster.startup import background_cluster
    from registry.runs.tracking import import_tracking_store

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: python -m flows.experiment CONFIG [key=value ...] "
            "[--activate KEY [--use-changed-code] | --continue KEY]",
            file=sys.stderr,
        )
        return 2
    try:  # before a Prefect server starts: a typo costs a second, not ten
        checked = checked or check_command_line(args)
        _check_settings()
    except (DetTasksError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = checked.cfg
    _say_where_runs_go(warm, cfg)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    workers = trials_at_once(cfg)
    with (
        # Without a cluster named, its workers start while Prefect's server does.
        contextlib.nullcontext()
        if os.environ.get(SCHEDULER_ENV)
        else background_cluster(workers, cfg.resources.slots_per_trial),
        quiet_prefect_shutdown(complete_errors=(TrialFailed, DetTasksError, StepFailed)),
        contextlib.ExitStack() as settings,
    ):
        try:
            import_tracking_store(os.environ.get("MLFLOW_TRACKING_URI", ""))  # as it starts
            if prestarted is not None:
                prestarted.wait_ready()  # its port is final now
            settings.enter_context(run_settings(prestarted.api_url if prestarted else None))
            start_shielded_prefect_server()  # no-op once prestarted (PREFECT_API_URL is set)
            state: Any = experiment(
                checked.config,
                checked.overrides,
                experiment_key=checked.experiment_key,
                use_changed_code=checked.use_changed_code,
                return_state=True,
            )
        except KeyboardInterrupt:
            print(
                "stopped at once (second signal): no checkpoint; runs ended KILLED", file=sys.stderr
            )
            return 130
        return _report(state)


def _check_settings() -> None:
    """DET_TASKS_WORKER_MEMORY_MB and DET_TASKS_STOP_GRACE_S, checked before anything starts."""
    from cluster.startup import worker_memory_mb
    from flows.stopping import stop_grace_s

    worker_memory_mb()
    stop_grace_s()


def _say_where_runs_go(warm: WarmServices | None, cfg: ExperimentConfig) -> None:
    """On stderr: the embedded defaults chosen, or the warm services used; then where the
    config's checkpoint_storage folder's checkpoints go."""
    chosen = use_embedded_defaults()
    if chosen:
        print(
            f"no MLFLOW_TRACKING_URI: runs go to {chosen['MLFLOW_TRACKING_URI']} "
            f"(browse: mlflow ui --backend-store-uri {chosen['MLFLOW_TRACKING_URI']})",
            file=sys.stderr,
        )
    if warm is not None:
        print(
            f"on the warm services of {det_tasks_home()}: Prefect {warm.prefect_api[:-4]}, "
            f"Dask {warm.scheduler} ({warm.workers} workers: at most {warm.workers} trials "
            f"at once); runs go to {warm.tracking_uri} (browse: mlflow ui "
            f"--backend-store-uri {warm.tracking_uri}); stop the services: "
            "python -m infra.warm_home stop",
            file=sys.stderr,
        )
    # A Determined user's checkpoint_storage folder is where they look (issue 50 item 6).
    where = honour_checkpoint_folder(cfg)
    if where:
        print(where, file=sys.stderr)


def _report(state: Any) -> int:
    """The flow run's outcome for the terminal: the summary as JSON (0), how to continue a
    stopped one (130), or the failure in one line after the user's frames (1)."""
    if state.is_cancelled():  # stopped on request: the message says how to continue
        print(state.message, file=sys.stderr)
        return 130
    try:
        result = state.result()
    except StepFailed as err:  # the user's frames once, then one line
        if err.user_traceback:
            print(err.user_traceback, file=sys.stderr)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # the flow run's log above has the details
        print(f"error: experiment failed: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    exit_without_final_collection(main(prestarted=_PRESTARTED, checked=_CHECKED, warm=_WARM))
