"""The warm-worker side of the experiment flow: what runs inside a Dask worker process.

Each worker holds at most one trial in memory (``det_tasks.runner.held.HeldTrial``) in a
Dask ``WorkerPlugin``, between that trial's train, validate and checkpoint tasks. Steps are
position-addressed: a step says at which batch it needs the trial. A worker that holds the
trial there uses it as it is; otherwise (a retry, another worker, a restarted worker) it
drops what it holds, restores the trial's newest checkpoint at or before that batch and
replays the batches in between, which the harness's exact resume makes bit-identical.

Trials that cannot be held in one process (script entrypoints, ``slots_per_trial > 1``)
train a whole segment per step in a ``det-tasks run`` process the worker starts (which
launches the torchrun/horovodrun world for multi-slot trials).

Recycling: once a worker has built ``DET_TASKS_WORKER_MAX_TRIALS`` trials (default 16) and
holds none, its step results say so (``recycle_due``) and the flow restarts it through
Dask's Nanny (``cluster.recycling.recycle``) before it places another step: leaks in user code
cannot accumulate, and no step is ever pinned to a worker that is going away (a worker that
restarted itself under a pinned step left that step in Dask's ``no-worker`` state for good).

Stopping: ``request_stop`` (run on every worker through ``Client.run``) sets the stop request
of the held trial's ``TrialControl`` (det_tasks.run_services) when it belongs to the
experiment being stopped; the training loop sees it at its next batch boundary, and the
train step returns early with ``preempted``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from distributed import Reschedule, Worker, WorkerPlugin, get_worker

from cluster.segment_output import last_output
from cluster.step_errors import crossing_error
from cluster.stop_requests import STOP_STATES
from cluster.worker_heap import DASK_TRIM_ENV, DASK_TRIM_THRESHOLD, reuse_freed_memory
from cluster.worker_process import exit_soon, shield_from_group_signals
from det_tasks.checkpoints.disk_full import NoRoomForCheckpoint, no_space
from det_tasks.config.entered import ENTERED_CONFIG_FLAG
from det_tasks.cpu_threads import worker_threads
from det_tasks.errors import (
    EXIT_INVALID_HP,
    ConfigError,
    InvalidHP,
    StepFailed,
    TrialError,
    TrialStopped,
)
from det_tasks.run_services import TrialControl
from det_tasks.runner.library_logs import quiet_library_loggers
from det_tasks.runner.stop_requests import STOP_FILE_ENV
from det_tasks.runner.trial_processes import TrialProcesses
from det_tasks.runner.trial_spec import TrialSpec
from det_tasks.user_frames import error_text, innermost_user_frame, user_traceback

if TYPE_CHECKING:
    from det_tasks.runner.held import HeldTrial
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import PARENT_TAG, TRIAL_TAG, client_for
from registry.servers.settings import RegistrySettings

__all__ = [
    "PLUGIN_NAME",
    "HeldTrialPlugin",
    "StepRequest",
    "StepResult",
    "TrialFailed",
    "last_output",
    "PREEMPT",
    "STOP_MODES",
    "exit_soon",
    "resume_candidates",
    "run_step",
    "shield_from_group_signals",
    "step_failure",
]

PLUGIN_NAME = "det-tasks-held-trial"
# Another experiment's held trial counts as active (not to be evicted) this long after its
# latest step; a step that finds one waits RESCHEDULE_PAUSE_S and asks Dask to place it again.
FOREIGN_ACTIVE_S = 10.0
RESCHEDULE_PAUSE_S = 0.2
MAX_TRIALS_ENV = "DET_TASKS_WORKER_MAX_TRIALS"  # trials a worker builds before it is recycled
DEFAULT_MAX_TRIALS = 16
STEP_KINDS = ("train", "validate", "checkpoint", "segment", "release")
# Determined's verbs: pause and cancel checkpoint at the stop batch, kill does not.
STOP_MODES = ("pause", "cancel", "kill")
PREEMPT = "preempt"  # a train step's ``preempted`` when the job queue asked it to give way


class TrialFailed(RuntimeError):
    """A trial's own process exited with an error; the message carries its last output."""


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """One position-addressed step of a trial: the trial must be at a batch in
    [``start``, ``stop``] to begin; train steps then train to ``stop``. ``stop`` None is
    the trial's searcher.max_length, turned into batches on the worker: records need only
    ``global_batch_size``, but epochs without ``records_per_epoch`` need the trial's data
    loader (its length is the epoch)."""

    trial: TrialSpec
    kind: str
    start: int
    stop: int | None
    parent_run_id: str
    experiment_id: str
    package: str | None = None  # s3://.../packages/<sha>.tar.gz: unpacked on the worker
    release_after: bool = False  # end the held trial (its MLflow run) after this step
    stopped_as: str | None = None  # with release_after: end its run KILLED, det.state this
    experiment_best: float | None = None  # checkpoint_policy best: the experiment's best so far
    pool_resource: str | None = None  # the Dask resource naming its pool's workers, if any

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step kind must be one of {STEP_KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Where and how a step ran, and what it produced."""

    worker: str
    host: str
    pid: int
    position: int
    warm: bool  # the trial was held here already, at a usable position
    seconds: float  # the step's time inside the worker (the work, plus any restore)
    restored_from: str | None = None
    validation: dict[str, Any] | None = None
    checkpoint: str | None = None
    stop_requested: bool = False
    invalid_hp: str | None = None  # the trial raised det.InvalidHP: the searcher drops it
    preempted: str | None = None  # a train step cut short by request_stop: its mode
    recycle_due: bool = False  # the worker holds nothing and has built its share of trials
    # A step that ended its trial (release_after): the trial's end after the work (its MLflow
    # run ended, metrics flushed, checkpoints collected, memory freed), in seconds.
    end_seconds: float | None = None
    # A release step: it found its trial held here and ended the trial's run. False: the
    # trial was not held (another trial's step evicted it first, ending its run PAUSED, or
    # its worker was gone), so the flow records the trial's end itself.
    released: bool = False


def resume_candidates(
    parent_run_id: str, experiment_id: str, trial_id: int, at_most: int | None = None
) -> list[str]:
    """URIs of the trial's checkpoints at or before batch ``at_most``, newest first (the
    first intact one is used); empty if it has none yet."""
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        return []
    client = client_for(settings.tracking_uri)
    runs = client.search_runs(
        [experiment_id],
        filter_string=(
            f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{PARENT_TAG}` = '{parent_run_id}'"
        ),
        max_results=1,
    )
    if not runs:
        return []
    records = checkpoint_records(client, runs[0].info.run_id)
    usable = [r for r in records if at_most is None or r["steps_completed"] <= at_most]
    return [r["uri"] for r in reversed(usable)]


class HeldTrialPlugin(WorkerPlugin):
    """A worker's held trial (one at a time) and its unpacked model packages.

    Registered once per cluster (``idempotent``): every flow run registers it, and Dask
    replaces a plugin registered again under its name by tearing the old one down on every
    worker, which released the trials other experiments held there, mid-step (their next
    step failed and spent a restart). The first registration's settings stay."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, max_trials: int | None = None) -> None:
        # None: the worker's own DET_TASKS_WORKER_MAX_TRIALS (read in setup), so whoever
        # started the workers decides, not whichever flow registered the plugin first.
        self.max_trials = max_trials
        self.held: HeldTrial | None = None
        self.built = 0
        self.packages: dict[str, Path] = {}
        self.worker: Worker | None = None
        # The held trial's stop request: set from the worker's event loop (Client.run),
        # read by the training loop at batch boundaries. Abandoned when the worker closes:
        # the running step's training is replayed on another worker, so its stop reports
        # nothing (counted once).
        self.control = TrialControl()
        self.stop_modes: dict[str, str] = {}  # experiment run key -> requested mode
        # Trials the cluster's job queue asked to give way: (experiment key, trial id).
        self.preempting: set[tuple[str, int]] = set()
        self.last_step_end = 0.0  # monotonic: when this worker's latest step ended
        self.closing = False  # the worker is closing: a running step stops (teardown)
        # Its Slurm job ends soon (cluster.slurm_warning): no trial is restored here again.
        self.leaving = False
        self.processes: TrialProcesses | None = None  # the held trial's own processes

    def __getstate__(self) -> dict[str, Any]:
        """Sent to each worker by the client: everything but the (per-process) control."""
        state = dict(self.__dict__)
        state.pop("control", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.control = TrialControl()

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        if self.max_trials is None:
            self.max_trials = int(os.environ.get(MAX_TRIALS_ENV, str(DEFAULT_MAX_TRIALS)))
        # For whatever runs on this worker (batch-inference shards too), not only trials.
        _train_on_the_workers_share()
        shield_from_group_signals()
        # A trial's own processes (DataLoader workers, torch.multiprocessing) start as they
        # do in `det-tasks run` and under Determined: the platform's default method (fork on
        # Linux), not the method this worker was started with (forkserver or spawn), whose
        # fresh interpreters cannot unpickle a trial's objects (they import `determined`,
        # which exists only where the harness set it up).
        multiprocessing.set_start_method(None, force=True)
        quiet_library_loggers()  # once per worker process, as det-tasks does per run
        # The held trial's harness (torch) now, not at the first trial; this module itself
        # imports no torch, so the flow that sends the steps does not load it.
        import det_tasks.runner.held  # noqa: F401

        # What a trial starts (subprocesses, pools, their children) ends with it, and with
        # this worker if it dies (det_tasks.runner.trial_processes).
        self.processes = TrialProcesses.start()

    def teardown(self, worker: Worker) -> None:
        # The worker is closing (its scheduler gone, or told to): a step running here is
        # given to another worker, so its training stops at the next batch boundary.
        self.closing = True
        self.control.abandon()
        self.release()
        for model in self.packages.values():
            shutil.rmtree(model.parent, ignore_errors=True)

    def trial_at(self, request: StepRequest, spec: TrialSpec) -> tuple[HeldTrial, bool]:
        """The trial at a batch in [start, stop]: the held one, or restored and replayed."""
        held = self.held
        if (
            held is not None
            and held.spec.key == spec.key
            and request.start <= held.position <= _bound(request.stop, held)
        ):
            return held, True
        if self.leaving:  # its job ends soon (cluster.slurm_warning): a trial starts elsewhere
            raise Reschedule()
        self.make_room_for(spec)
        self.release()
        _train_on_the_workers_share()
        resume = resume_candidates(
            request.parent_run_id, request.experiment_id, spec.trial_id, at_most=request.stop
        )
        if self.processes is not None:
            self.processes.begin()
        from det_tasks.runner.held import HeldTrial  # imported by setup() already

        try:
            self.held = HeldTrial(spec, resume)
        except InvalidHP:  # dropped by the searcher: what its __init__ started ends
            self._end_trial_processes()
            raise
        self.built += 1
        if self.held.position < request.start:
            self.held.train_to(request.start)  # replay: exact, from the restored checkpoint
        return self.held, False

    def make_room_for(self, spec: TrialSpec) -> None:
        """Refuse to evict another experiment's trial while its chain is active (raises
        Dask's Reschedule, after a pause, so the step goes to another worker or comes back
        later). Experiments share the workers of a stack, and each flow places its own steps
        only: a step of one landed between two steps of another's trial, evicted it, and
        that trial replayed its batches from its last checkpoint (from batch 0 without
        one). A trial idle for FOREIGN_ACTIVE_S (waiting on its searcher, or its flow is
        gone) is evicted as before: it restores from its checkpoint when needed."""
        held = self.held
        if held is None or held.spec.experiment_run_key == spec.experiment_run_key:
            return
        if time.monotonic() - self.last_step_end < FOREIGN_ACTIVE_S:
            time.sleep(RESCHEDULE_PAUSE_S)
            raise Reschedule()

    def foreign_active(self, experiment_key: str | None) -> bool:
        """Whether this worker holds another experiment's trial whose chain is active."""
        held = self.held
        return (
            held is not None
            and held.spec.experiment_run_key != experiment_key
            and time.monotonic() - self.last_step_end < FOREIGN_ACTIVE_S
        )

    def release(self, error: BaseException | None = None) -> None:
        """Drop the held trial (ending its MLflow run) and free its memory (GPU included)."""
        held, self.held = self.held, None
        if not self.closing:
            self.control.set_stop_requested(False)
        if held is None:
            self._end_trial_processes()
            return
        try:
            held.close(error)
        finally:
            del held
            gc.collect()
            # What survives a trial's end belongs to the worker (imported modules, MLflow's
            # stores, caches): frozen, the next trial's end and training's own full
            # collections skip it instead of scanning it again (a full collection here
            # took 0.8-1.6 s of a loaded worker's trial end; forkserver_heap freezes what
            # was imported before fork the same way).
            gc.freeze()
            _empty_cuda_cache()
            self._end_trial_processes()

    def _end_trial_processes(self) -> None:
        """End what the released trial started (its code's processes and theirs)."""
        if self.processes is not None:
            self.processes.end()

    @property
    def recycle_due(self) -> bool:
        return self.held is None and self.built >= (self.max_trials or DEFAULT_MAX_TRIALS)

    def stop(self, experiment_key: str, mode: str) -> bool:
        """Ask the held trial to stop at its next batch boundary if it is the experiment's;
        True if it is."""
        self.stop_modes[experiment_key] = mode
        held = self.held
        if held is not None and held.spec.experiment_run_key == experiment_key:
            self.control.request_stop()
            return True
        return False

    def preempt(self, experiment_key: str, trial_id: int) -> bool:
        """Ask the trial to give way at its next batch boundary (or as its next train step
        begins); True if this worker holds it now."""
        self.preempting.add((experiment_key, trial_id))
        held = self.held
        if held is not None and _preempt_key(held.spec) == (experiment_key, trial_id):
            self.control.request_stop()
            return True
        return False

    def local_spec(self, request: StepRequest) -> TrialSpec:
        """The trial spec with paths on this worker: a model package is downloaded and
        unpacked once per worker. The config travels in the spec (no file is written)."""
        if request.package is None:
            return request.trial
        from registry.experiments.packages import fetch_package

        if request.package not in self.packages:
            self.packages[request.package] = fetch_package(request.package)
        return dataclasses.replace(request.trial, model_dir=str(self.packages[request.package]))


def run_step(request: StepRequest) -> StepResult:
    """Run one step on this worker (the function the flow's tasks submit to Dask).

    The step runs with malloc's thresholds raised (cluster.worker_heap): under Dask's own
    setting every allocation over 128 KiB (a batch, a layer's activations) was mapped and
    page-faulted afresh each batch: bench/worker_heap.py measured the MNIST CNN's CPU step
    in a worker at 71.9 ms of CPU and 9,535 faults, 43.3 ms and 31 faults inside the block
    (a plain process: 57.0 ms). The heap is trimmed after the step, so the worker still
    returns memory between steps as Dask intends."""
    try:
        with reuse_freed_memory():
            return _run_step(request)
    except Exception as err:  # sent back pickled: one that cannot be, as plain text
        plain = crossing_error(err)
        if plain is err:
            raise
        raise plain from None
    finally:
        plugin = get_worker().plugins.get(PLUGIN_NAME)
        if isinstance(plugin, HeldTrialPlugin):
            plugin.last_step_end = time.monotonic()


def _run_step(request: StepRequest) -> StepResult:
    worker = get_worker()
    plugin = _held_trial_plugin(worker)
    started = time.perf_counter()
    spec = plugin.local_spec(request)
    if request.kind == "release":
        return _release(worker, plugin, request, spec, started)
    if request.kind == "segment":
        return _segment(worker, plugin, request, spec, started)
    try:
        trial, warm = plugin.trial_at(request, spec)
    except InvalidHP as err:  # rejected in __init__: nothing is held
        return _result(worker, request.start, False, started, invalid_hp=str(err))
    except Reschedule:  # another experiment's active trial is here (make_room_for)
        raise
    except (Exception, SystemExit) as err:  # building or restoring the trial failed
        held = plugin.held
        failure = step_failure(spec, "setup", held.position if held else request.start, err)
        plugin.release(ended_by(failure))
        raise failure from None
    restored = None if warm else trial.restored_from
    try:
        validation, uri = _work(request, trial, plugin, spec)
        result = _result(
            worker,
            trial.position,
            warm,
            started,
            restored_from=restored,
            validation=validation,
            checkpoint=uri,
            stop_requested=trial.stop_requested,
            preempted=_preempted(plugin, spec) if request.kind == "train" else None,
        )
        if request.kind == "train":  # the queue's request is spent, whether it came in time
            plugin.preempting.discard(_preempt_key(spec))
    except InvalidHP as err:
        plugin.release()  # dropped by the searcher, not failed
        return _result(worker, trial.position, warm, started, invalid_hp=str(err))
    # sys.exit() in the trial's code is its failure, not the worker's end (Dask's executor
    # thread would otherwise take the worker down with it, and the user read KilledWorker).
    except (Exception, SystemExit) as err:
        failure = step_failure(spec, request.kind, trial.position, err)
        plugin.release(ended_by(failure))
        raise failure from None
    except BaseException as err:
        plugin.release(err)
        raise
    if request.release_after:
        ending = time.perf_counter()
        plugin.release(_stopped(request))
        return dataclasses.replace(
            result,
            recycle_due=plugin.recycle_due,
            end_seconds=round(time.perf_counter() - ending, 4),
        )
    return result


def _release(
    worker: Worker, plugin: HeldTrialPlugin, request: StepRequest, spec: TrialSpec, started: float
) -> StepResult:
    """End the trial if this worker still holds it where its last step left it; the result
    says whether it did (an evicted trial's run is the flow's to end)."""
    held = plugin.held
    released = held is not None and held.spec.key == spec.key and held.position == request.stop
    if released:
        plugin.release(_stopped(request))
    return _result(
        worker, request.stop or 0, True, started, recycle_due=plugin.recycle_due, released=released
    )


# How long a step waits for the plugin on a worker that joined without it: a worker
# restarted with its scheduler gets it when the flow re-registers it (cluster.reconnect),
# which may be a moment after the step itself reached the worker.
PLUGIN_WAIT_S = 60.0


def _held_trial_plugin(worker: Worker) -> HeldTrialPlugin:
    deadline = time.monotonic() + PLUGIN_WAIT_S
    plugin = worker.plugins.get(PLUGIN_NAME)
    while not isinstance(plugin, HeldTrialPlugin) and time.monotonic() < deadline:
        time.sleep(0.1)
        plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, HeldTrialPlugin):
        raise RuntimeError(
            f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: connect through "
            "cluster.startup.dask_client(), which registers it"
        )
    return plugin


def _work(
    request: StepRequest, trial: HeldTrial, plugin: HeldTrialPlugin, spec: TrialSpec
) -> tuple[dict[str, Any] | None, str | None]:
    """The step's work on the held trial: train to its stop (its validation and checkpoint
    ``None``), validate, or checkpoint."""
    if request.kind == "train":
        trial.set_experiment_best(request.experiment_best)
        plugin.control.set_stop_requested(False)
        asked = _preempt_key(spec) in plugin.preempting
        if asked or (spec.experiment_run_key or "") in plugin.stop_modes:  # before it began
            plugin.control.request_stop()
        trial.train_to(_bound(request.stop, trial), plugin.control)
        return None, None
    if request.kind == "validate":
        return trial.validate(), None
    _, uri = trial.checkpoint()
    return None, uri


def _train_on_the_workers_share() -> None:
    """Dask's Nanny gives every worker OMP_NUM_THREADS=1; whoever started the worker says
    how many cores its trials train on (a lone worker on 2 cores trained the MNIST CNN 1.45x
    slower on one thread). Set for each new trial: a trial's own ``torch.set_num_threads``
    must not carry over to the next."""
    threads = worker_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def step_failure(spec: TrialSpec, kind: str, batch: int, err: BaseException) -> StepFailed:
    """What the user reads about a failed step: the trial, the user's function that raised
    (else the step's kind) and its batch, the error, and the user's frames. A config or
    entrypoint error is final: a retry would meet it again, and so would a full disk, which
    is not the trial's fault: it stops the trial resumably (``ended_by``)."""
    if isinstance(err, StepFailed):
        return err
    full = no_space(err)
    if full is not None:
        return NoRoomForCheckpoint(spec.trial_id, batch, full.folder, full.why)
    model_dir = Path(spec.model_dir)
    frame = innermost_user_frame(err, model_dir)
    return StepFailed(
        spec.trial_id,
        frame.described if frame else kind,
        batch,
        error_text(err),
        frame.location if frame else None,
        retryable=not isinstance(err, (ConfigError, TrialError)),
        user_traceback=user_traceback(err, model_dir),
    )


def ended_by(failure: StepFailed) -> BaseException:
    """How a failed step ends its trial's run: FAILED with the failure, or, for a full disk,
    KILLED with det.state PAUSED, to continue from its last good checkpoint once there is
    room (the flow pauses the experiment: flows.disk_full)."""
    if isinstance(failure, NoRoomForCheckpoint):
        return TrialStopped(STOP_STATES["pause"], failure.error)
    return failure


def _preempted(plugin: HeldTrialPlugin, spec: TrialSpec) -> str | None:
    """Why a train step stopped early: the experiment's stop mode, or PREEMPT (the job
    queue's request, spent once the step returns)."""
    if not plugin.control.should_preempt():
        return None
    mode = plugin.stop_modes.get(spec.experiment_run_key or "")
    if mode is None and _preempt_key(spec) in plugin.preempting:
        return PREEMPT
    return mode or "kill"


def _preempt_key(spec: TrialSpec) -> tuple[str, int]:
    return (spec.experiment_run_key or "", spec.trial_id)


def _stopped(request: StepRequest) -> TrialStopped | None:
    """The reason a released trial's run ends KILLED, when it was stopped on request."""
    return TrialStopped(request.stopped_as) if request.stopped_as else None


def _bound(stop: int | None, trial: HeldTrial) -> int:
    return trial.max_batches if stop is None else stop


def _result(worker: Worker, position: int, warm: bool, started: float, **more: Any) -> StepResult:
    return StepResult(
        worker=str(worker.address),
        host=socket.gethostname(),
        pid=os.getpid(),
        position=position,
        warm=warm,
        seconds=round(time.perf_counter() - started, 4),
        **more,
    )


def _segment(
    worker: Worker, plugin: HeldTrialPlugin, request: StepRequest, spec: TrialSpec, started: float
) -> StepResult:
    """Train to ``stop`` with validation and checkpoint in a ``det-tasks run`` process."""
    resume = resume_candidates(
        request.parent_run_id, request.experiment_id, spec.trial_id, at_most=request.stop
    )
    with tempfile.TemporaryDirectory() as tmp:
        summary_file = Path(tmp) / "summary.json"
        cmd = _segment_command(request, spec, resume, summary_file)
        if spec.config is not None:  # the flow's entered config: the segment validates nothing
            cmd += [ENTERED_CONFIG_FLAG, str(spec.config.write(Path(tmp) / "config.pickle"))]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if share := worker_threads():  # not the Nanny's OMP_NUM_THREADS=1
            env["OMP_NUM_THREADS"] = str(share)
        # A plain process for the segment, not one with Dask's malloc setting (see run_step).
        if env.get(DASK_TRIM_ENV) == DASK_TRIM_THRESHOLD:
            del env[DASK_TRIM_ENV]
        env[STOP_FILE_ENV] = str(Path(tmp) / "stop")  # a Core API script's should_preempt()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        mode = _pass_stop_requests(plugin, spec, proc, Path(env[STOP_FILE_ENV]))
        _, stderr = proc.communicate()
        plugin.preempting.discard(_preempt_key(spec))  # the queue's request is spent
        if mode == ["kill"]:  # killed at once, as Determined kills: nothing more to read
            return _result(worker, request.start, False, started, preempted="kill")
        if proc.returncode == EXIT_INVALID_HP:
            reason = json.loads(summary_file.read_text()).get("invalid_hp", "")
            return _result(worker, request.start, False, started, invalid_hp=str(reason))
        if proc.returncode != 0:
            raise TrialFailed(
                f"trial {spec.trial_id} failed (exit code {proc.returncode}); last output:\n"
                + last_output(stderr)
            )
        summary = json.loads(summary_file.read_text())
    return _result(
        worker,
        int(summary["batches_trained"]),
        False,
        started,
        restored_from=resume[0] if resume else None,
        validation=summary.get("validation"),
        checkpoint=summary.get("checkpoint"),
        preempted=mode[0] if summary.get("stopped") else None,
    )


def _segment_command(
    request: StepRequest, spec: TrialSpec, resume: list[str], summary_file: Path
) -> list[str]:
    """The ``det-tasks run`` command line of a segment."""
    cmd = [sys.executable, "-m", "det_tasks.runner.cli", "run", spec.config_path]
    cmd += [spec.model_dir, "--no-progress", "--trial-id", str(spec.trial_id)]
    cmd += ["--hparams", json.dumps(spec.hparams), "--summary-file", str(summary_file)]
    if request.stop is not None:
        cmd += ["--max-batches", str(request.stop)]
    if spec.experiment_run_key:
        cmd += ["--experiment-run", spec.experiment_run_key]
    for uri in resume:
        cmd += ["--resume", uri]
    if spec.device:
        cmd += ["--device", spec.device]
    if request.experiment_best is not None:  # a script's get_experiment_best_validation()
        cmd += ["--experiment-best", repr(float(request.experiment_best))]
    if spec.config is None:  # applied already in an entered config
        for item in spec.overrides:
            cmd += ["--param", item]
    return cmd


def _pass_stop_requests(
    plugin: HeldTrialPlugin, spec: TrialSpec, proc: subprocess.Popen[str], stop_file: Path
) -> list[str]:
    """Until ``proc`` ends, pass a pause, cancel or the queue's preemption of the segment's
    trial on to its script (det_tasks.runner.stop_requests), or kill it with every process
    it started (a kill asks nothing of the script, as in Determined). Returns a list the
    stop mode is put in, once asked."""
    asked: list[str] = []
    key = spec.experiment_run_key or ""

    def watch() -> None:
        while proc.poll() is None and not asked:
            mode = plugin.stop_modes.get(key)
            if mode is None and _preempt_key(spec) in plugin.preempting:
                mode = PREEMPT
            if mode in ("pause", "cancel", PREEMPT):
                asked.append(mode)
                state = "PREEMPTED" if mode == PREEMPT else STOP_STATES[mode]
                stop_file.write_text(state, encoding="utf-8")
            elif mode == "kill":
                asked.append(mode)
                _kill_tree(proc.pid)
            time.sleep(0.2)

    threading.Thread(target=watch, name="det-tasks-segment-stop", daemon=True).start()
    return asked


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every process it started, all collected first (a launcher's
    ranks run in sessions of their own, and die with it only when killed themselves)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _empty_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
