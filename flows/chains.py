"""An experiment's trials as chains of Prefect tasks on warm workers.

Each segment the searcher hands out (train trial T until batch B) becomes three tasks,
submitted one after another as each finishes, each taking the previous one as its input:
``train trial-T A-B`` -> ``validate trial-T @B`` -> ``checkpoint trial-T @B``; the next
segment of the same trial (an ASHA promotion) takes that checkpoint task as its input, so
Prefect's graph draws every trial as one chain. At most ``max_concurrent_trials`` segments
run at once; a trial the searcher continues right away starts first, on the worker that
still holds it. A trial it does not continue is released (its worker frees the memory, GPU
included) until a promotion restores it from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.states import Cancelled

from cluster.held_trials import PREEMPT, StepResult
from cluster.job_slots import JobSlots
from cluster.placement import Placement
from cluster.recycling import Recycler
from cluster.steps import (
    kill_worker_process,
    preempt_on,
    stop_everywhere,
    workers_running,
)
from det_tasks.config import ExperimentConfig
from det_tasks.config.entered import EnteredConfig
from det_tasks.runner.trial_spec import TrialSpec, holdable
from det_tasks.searchers.base import Searcher, Work
from flows.searcher_reports import better, persist, searcher_metric
from flows.stopping import STOP_GRACE_ENV, StopControl, stop_grace_s
from flows.tasks import TrialRef, checkpoint, train, validate
from flows.trial_releases import TrialReleases
from flows.trial_table import PRUNED, TrialTable
from registry.checkpoints.models import trial_runs
from registry.checkpoints.store import checkpoint_records
from registry.jobs.trial_services import trial_run_tags
from registry.runs.run_records import QUEUE_REASON_TAG
from registry.runs.searcher_state import STATE_TAG
from registry.runs.tracking import STATE_TAG as RUN_STATE_TAG
from registry.runs.tracking import TRIAL_TAG, ExperimentRuns
from registry.runs.trial_states import CANCELED, ERROR, PREEMPTED, QUEUED, STOPPED

__all__ = ["STATE_TAG", "TrialChains", "final_segment"]


@dataclasses.dataclass(frozen=True)
class _Stage:
    work: Work
    ref: TrialRef
    kind: str
    future: Any  # PrefectFuture
    release: bool = False
    stopped: bool = False  # the checkpoint of a trial stopped on request (not a segment end)
    preempted: bool = False  # the checkpoint of a trial giving its slot to more urgent work


QUEUE_WAIT_S = 0.5  # how often a flow whose trials all wait asks the job queue again


def final_segment(work: Work, cfg: ExperimentConfig) -> bool:
    """Whether ``work`` trains its trial to the searcher's full length (in batches: a length
    in records, or epochs with records_per_epoch, is compared converted, not as written)."""
    return work.batches is None or work.batches == cfg.max_length_in_batches()


class TrialChains:
    """Submits and follows every trial's task chain for one experiment run."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        raw: dict[str, Any],
        runs: ExperimentRuns,
        config_path: Path,
        model_path: Path,
        overrides: list[str],
        run_key: str,
        package: str | None,
        table: TrialTable,
        placement: Placement,
    ) -> None:
        self.cfg, self.raw, self.runs = cfg, raw, runs
        # The config as the flow entered it, sent to every trial in its spec: no worker or
        # segment reads the file or validates again.
        self.entered = EnteredConfig(raw, cfg)
        self.config_path, self.model_path = config_path, model_path
        self.overrides, self.run_key, self.package = overrides, run_key, package
        self.table = table
        self.placement = placement
        self.recycler = Recycler(placement)
        self.refs: dict[int, TrialRef] = {}
        self.last: dict[int, Any] = {}  # trial -> its latest checkpoint task's future
        self.position: dict[int, int] = {}
        self.releases = TrialReleases(runs)
        self.best: dict[str, Any] | None = None
        self.stop: StopControl | None = None
        self.grace_s = stop_grace_s()
        self.killed: set[int] = set()  # trials whose workers _kill_overdue killed
        # The cluster's job queue (None: every offered trial starts, as on a private cluster).
        self.queue: JobSlots | None = None
        self.pool_resource: str | None = None  # what its steps ask of a worker (pools)
        self.giving_way: set[int] = set()  # trials asked to give way, until their train ends
        self.waiting: dict[int, str] = {}  # queued trials -> why they wait (as recorded)

    def run(
        self, todo: list[Work], searcher: Searcher, limit: int, stop: StopControl | None = None
    ) -> dict[str, Any] | None:
        """Run until the searcher has no more work, or until ``stop`` asks to pause, cancel
        or kill (running trials then stop at their next batch boundary); returns the best
        trial's summary."""
        self.stop = stop
        self._settle_pruned(searcher)
        running: dict[Future[Any], _Stage] = {}
        active = 0
        try:
            while (todo and not self._stopping) or running:
                self.recycler.reap()
                # One trial per worker: more chains than workers would only evict each
                # other's held trials (correct, via checkpoints, but replaying work). While
                # a worker is being recycled nothing is left to Dask's choice, which could
                # be that worker.
                available = len(self.placement.workers())
                if self.placement.on_demand:  # the queue's wants start the workers
                    available = max(available, limit)
                capacity = min(limit, available if self.recycler.busy else max(1, available))
                for work in self._admitted(todo, capacity - active, list(running.values())):
                    stage = self._start(work)
                    running[_as_future(stage.future)] = stage
                    active += 1
                waited = [*running, *self.recycler.pending()]
                if waited:
                    done, _ = wait_futures(waited, timeout=1.0, return_when=FIRST_COMPLETED)
                else:  # every trial waits for a slot of the shared cluster: ask again soon
                    done = set()
                    time.sleep(QUEUE_WAIT_S)
                self._poll_stop()
                self._kill_overdue(running.values())
                self.table.publish_if_stale()
                for fut in done:
                    if fut not in running:  # a recycled worker is back
                        continue
                    stage = running.pop(fut)
                    if self._was_killed(stage, fut):
                        active -= 1
                        continue
                    nxt = self._follow(stage, fut)
                    if nxt is not None:
                        running[_as_future(nxt.future)] = nxt
                        continue
                    active -= 1
                    todo[:0], later = self._end_segment(stage, fut.result(), searcher)
                    todo.extend(later)
        except BaseException:
            self.recycler.close(wait=False)
            raise
        self.recycler.close()
        if not self._stopping:
            for row in self.table.rows.values():
                if row.state == "PAUSED":
                    row.state = "STOPPED"
        else:
            self._settle_waiting()
        return self.best

    # ---- the cluster's job queue (cluster.job_queue) ------------------------------------
    def _admitted(self, todo: list[Work], room: int, stages: list[_Stage]) -> list[Work]:
        """The work that starts now: what the queue grants of the first ``room`` items
        (all of them without a queue). Trials it preempts are asked to give way; the rest
        wait, QUEUED, with the queue's reason."""
        offered = [] if self._stopping else todo[: max(0, room)]
        granted = offered
        if self.queue is not None:
            running = sorted({s.work.trial_id for s in stages})
            turn = self.queue.sync([w.trial_id for w in offered], running)
            granted = [w for w in offered if w.trial_id in turn.grants]
            self._give_way(set(turn.preempt), stages)
            self._wait([w for w in offered if w not in granted], turn.reason)
        for work in granted:
            todo.remove(work)
            self.waiting.pop(work.trial_id, None)
        return granted

    def _give_way(self, trials: set[int], stages: list[_Stage]) -> None:
        """Ask the queue's chosen trials, while they train, to checkpoint at their next
        batch boundary and free their slot."""
        client = self.placement.client
        for stage in stages:
            trial_id = stage.work.trial_id
            if trial_id not in trials or stage.kind != "train" or trial_id in self.giving_way:
                continue
            workers = workers_running(client, self.run_key, trial_id)
            if workers:  # not yet on a worker: asked at the next decision
                preempt_on(client, workers, self.run_key, trial_id)
                self.giving_way.add(trial_id)
                get_run_logger().info(
                    "trial %d gives its slot to more urgent work: it checkpoints at its next "
                    "batch boundary and resumes there when a slot frees",
                    trial_id,
                )

    def _wait(self, works: list[Work], reason: str) -> None:
        """Trials the queue holds back: QUEUED (a preempted one stays PREEMPTED) in the
        table and on their MLflow runs, with the reason (recorded when it changes)."""
        reason = reason or "waiting for a slot"
        for work in works:
            trial_id = work.trial_id
            if self.waiting.get(trial_id) == reason:
                continue
            began = trial_id not in self.waiting  # else only the reason changed
            self.waiting[trial_id] = reason
            ref = self._ref(work)
            preempted = self.table.rows[trial_id].state == PREEMPTED
            if began and not preempted:
                self.runs.queued(ref.mlflow_run_id)
            self.table.set_state(trial_id, PREEMPTED if preempted else QUEUED, reason)
            self.runs.client.set_tag(ref.mlflow_run_id, QUEUE_REASON_TAG, reason)
            self.table.publish_soon()

    def _settle_waiting(self) -> None:
        """The experiment stopped: trials still waiting for a slot end as it did."""
        assert self.stop is not None
        for trial_id, row in self.table.rows.items():
            if row.state in (QUEUED, PREEMPTED):
                self.runs.finish(row.mlflow_run_id, "KILLED", self.stop.state or CANCELED)
                self.table.set_state(trial_id, self.stop.state or CANCELED)

    def _gave_way(self, stage: _Stage, result: StepResult) -> list[Work]:
        """A preempted trial checkpointed and freed its slot: its work goes back to the
        front of the queue, to resume from that checkpoint."""
        self._stopped(stage, result, PREEMPTED)
        get_run_logger().info(
            "trial %d preempted at batch %d, checkpoint %s: it waits for a slot",
            stage.work.trial_id,
            result.position,
            result.checkpoint,
        )
        return [stage.work]

    def _follow(self, stage: _Stage, fut: Future[Any]) -> _Stage | None:
        """A finished step: the chain's next stage, submitted (None: the segment ended)."""
        try:
            result: StepResult = fut.result()
        except BaseException:
            self.table.set_state(stage.work.trial_id, ERROR)
            self.table.publish()
            raise
        self.placement.ran(stage.work.trial_id, result.worker)
        if stage.release:  # the step ended the held trial on its worker
            self.placement.released(stage.work.trial_id)
        if stage.kind == "train":
            self.giving_way.discard(stage.work.trial_id)
        if result.recycle_due:  # between steps: it holds nothing, nothing is placed on it
            self.recycler.start(result.worker)
        return self._next(stage, result)

    def _end_segment(
        self, stage: _Stage, result: StepResult, searcher: Searcher
    ) -> tuple[list[Work], list[Work]]:
        """A segment ended, stopped on request or done: (this trial's continuation, other
        new work)."""
        if stage.preempted:
            return self._gave_way(stage, result), []
        if result.preempted is not None or stage.stopped:
            assert self.stop is not None and self.stop.state is not None
            self._stopped(stage, result, self.stop.state)
            return [], []
        return self._segment_done(stage, result, searcher)

    @property
    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.mode is not None

    def _poll_stop(self) -> None:
        """Pass a new stop request on to the workers holding this experiment's trials."""
        if self.stop is None:
            return
        mode = self.stop.poll()
        if mode is not None:
            asked = stop_everywhere(self.placement.client, self.stop.experiment_key, mode)
            get_run_logger().warning(
                "%s requested: %d running trial(s) stop at their next batch boundary%s; one "
                "that has not within %.0f s is killed (%s); a second Ctrl-C stops at once",
                mode,
                asked,
                "" if mode == "kill" else " and checkpoint there",
                self.grace_s,
                STOP_GRACE_ENV,
            )

    def _kill_overdue(self, stages: Iterable[_Stage]) -> None:
        """Stages still running ``stop_grace_s`` after a stop request (a trial stuck in user
        code, where no batch boundary comes): their workers are killed, at once."""
        if self.stop is None or not self.stop.overdue(self.grace_s):
            return
        client = self.placement.client
        for stage in stages:
            trial_id = stage.work.trial_id
            if stage.stopped or trial_id in self.killed:
                continue  # a stopped trial's own checkpoint is what the stop asked for
            self.killed.add(trial_id)
            workers = workers_running(client, self.run_key, trial_id)
            for worker in workers:
                kill_worker_process(client, worker)
            get_run_logger().warning(
                "trial %d did not reach a batch boundary within %.0f s of the %s request "
                "(%s sets how long): killed its worker %s; no checkpoint, it continues from "
                "its last one",
                trial_id,
                self.grace_s,
                self.stop.mode,
                STOP_GRACE_ENV,
                ", ".join(workers) or "(none running it)",
            )

    def _was_killed(self, stage: _Stage, fut: Future[Any]) -> bool:
        """A stage that failed because ``_kill_overdue`` killed its worker: the trial ends
        as stopped (its run KILLED with the experiment's state), not as a failure."""
        if stage.work.trial_id not in self.killed or fut.exception() is None:
            return False
        assert self.stop is not None
        self.placement.done(stage.work.trial_id)
        self.table.set_state(stage.work.trial_id, self.stop.state or "CANCELED")
        self.table.publish_soon()
        return True

    def _stopped(self, stage: _Stage, result: StepResult, state: str) -> None:
        """A trial stopped on request, or preempted: its worker is free; its row says so
        (``state``) with the checkpoint it stopped at."""
        trial_id = stage.work.trial_id
        self.last[trial_id] = stage.future
        self.position[trial_id] = result.position
        self.placement.done(trial_id)
        self.table.set_state(trial_id, state)
        if stage.kind == "train":  # killed: no checkpoint; the held trial is dropped
            self._release(stage.ref, result, state)
        if stage.kind == "checkpoint" and result.checkpoint:
            self.table.segment_done(trial_id, result.position, math.nan, result.checkpoint)
        self.table.publish_soon()

    def wait_releases(self, timeout_s: float = 120.0) -> None:
        self.releases.wait(timeout_s)

    # ---- steps --------------------------------------------------------------------------
    def _start(self, work: Work) -> _Stage:
        ref = self._ref(work)
        trial_id = work.trial_id
        if trial_id not in self.position:  # first started here: it may continue (activate)
            self.position[trial_id] = resumed_at(self.runs.client, ref.mlflow_run_id, work.batches)
        start = self.position[trial_id]
        # None: to searcher.max_length, which the worker turns into batches (epochs and
        # records need the trial's data loader).
        stop = work.batches
        workers = self.placement.claim(trial_id)
        self.releases.restarted(trial_id)
        self.table.set_state(trial_id, "RUNNING")
        future = train.with_options(
            task_run_name=ref.task_name("train", f"{start}-{self._label(stop)}"),
            retries=self.cfg.max_restarts,
        ).submit(
            ref,
            start,
            stop,
            after=self.last.get(trial_id),
            workers=workers,
            experiment_best=self.best["metric"] if self.best else None,
        )
        return _Stage(work, ref, "train", future)

    def _label(self, stop: int | None) -> str:
        if stop is not None:
            return str(stop)
        if not self.cfg.has_max_length:  # a script that decides how long it trains
            return "end"
        length = self.cfg.max_length
        return str(length.value) if length.unit == "batches" else f"{length.value} {length.unit}"

    def _next(self, stage: _Stage, result: StepResult) -> _Stage | None:
        ref, retries = stage.ref, self.cfg.max_restarts
        if result.invalid_hp is not None:
            return None
        if stage.kind == "train" and result.preempted == PREEMPT:
            _end_cancelled(stage.future, result)
            # Determined's preemption: a checkpoint at the stop batch, the slot freed.
            name = ref.task_name("checkpoint", f"@{result.position}")
            future = checkpoint.with_options(task_run_name=name, retries=retries).submit(
                ref, after=stage.future, release=True, stopped_as=PREEMPTED
            )
            return _Stage(stage.work, ref, "checkpoint", future, True, preempted=True)
        if stage.kind == "train" and result.preempted is not None:
            _end_cancelled(stage.future, result)
            if result.preempted == "kill" or self.stop is None or self.stop.state is None:
                return None
            # Pause and cancel: a checkpoint at the stop batch, no validation (Determined's
            # preemption), then the trial's run ends KILLED with the experiment's state.
            name = ref.task_name("checkpoint", f"@{result.position}")
            future = checkpoint.with_options(task_run_name=name, retries=retries).submit(
                ref, after=stage.future, release=True, stopped_as=self.stop.state
            )
            return _Stage(stage.work, ref, "checkpoint", future, True, stopped=True)
        if stage.kind == "train":
            name = ref.task_name("validate", f"@{result.position}")
            future = validate.with_options(task_run_name=name, retries=retries).submit(
                ref, after=stage.future
            )
            return _Stage(stage.work, ref, "validate", future)
        if stage.kind == "validate":
            release = final_segment(stage.work, self.cfg) or result.stop_requested
            name = ref.task_name("checkpoint", f"@{result.position}")
            future = checkpoint.with_options(task_run_name=name, retries=retries).submit(
                ref, after=stage.future, release=release
            )
            return _Stage(stage.work, ref, "checkpoint", future, release)
        return None

    def _segment_done(
        self, stage: _Stage, result: StepResult, searcher: Searcher
    ) -> tuple[list[Work], list[Work]]:
        """Report to the searcher; returns (this trial's continuation, other new work)."""
        work, trial_id = stage.work, stage.work.trial_id
        self.last[trial_id] = stage.future
        self.position[trial_id] = result.position
        self.placement.done(trial_id)
        if result.invalid_hp is not None:  # det.InvalidHP: dropped, maybe replaced
            self.table.set_state(trial_id, "INVALID_HP")
            self.table.publish_soon()
            replacements = searcher.report_invalid(trial_id)
            persist(searcher, self.runs)
            return [], replacements
        metric = searcher_metric(result.validation, self.cfg)
        new = searcher.report(trial_id, result.position, metric)
        persist(searcher, self.runs)
        mine = [w for w in new if w.trial_id == trial_id]
        others = [w for w in new if w.trial_id != trial_id]
        self.table.segment_done(trial_id, result.position, metric, result.checkpoint)
        if stage.release:
            self.table.set_state(trial_id, "COMPLETED")
        elif not mine:
            pruned = trial_id in searcher.pruned()
            # STOPPED unless promoted later
            self.table.set_state(trial_id, PRUNED if pruned else "PAUSED")
            self._release(stage.ref, result, STOPPED)
            if pruned:
                self._mark_pruned(stage.ref)
        elif self._stopping:  # its next segment waits for activate (in the searcher state)
            assert self.stop is not None
            self.table.set_state(trial_id, self.stop.state or "PAUSED")
            self._release(stage.ref, result, self.stop.state)
            mine = []
        self.table.publish_soon()
        if self.best is None or better(metric, self.best["metric"], self.cfg):
            self.best = {
                "trial_id": trial_id,
                "metric": metric,
                "hparams": work.hparams,
                "checkpoint": result.checkpoint,
                "batches_trained": result.position,
            }
        return mine, others

    def _release(self, ref: TrialRef, result: StepResult, stopped_as: str | None = None) -> None:
        """Free the paused trial's worker (fire and forget; awaited at the end);
        ``stopped_as``: its run's det.state (STOPPED by the searcher: FINISHED; PAUSED or
        CANCELED on request: KILLED)."""
        self.placement.released(ref.spec.trial_id)  # held or not, its worker holds none of it
        if ref.holdable:
            self.releases.submit(ref, result, stopped_as)

    def settle_releases(self) -> None:
        """End the runs of released trials their release did not find held
        (flows.trial_releases); once no step runs any more, after the sweep that releases
        what is still held."""
        pruned = {t for t, row in self.table.rows.items() if row.state == PRUNED}
        run_ids = {t: ref.mlflow_run_id for t, ref in self.refs.items()}
        self.releases.settle(run_ids, pruned)

    def _mark_pruned(self, ref: TrialRef) -> None:
        """det.state PRUNED on the trial's run once its release has ended it (FINISHED):
        the pruner, not the trial, decided it would not reach max_length."""

        def tag(_: object = None) -> None:
            self.runs.client.set_tag(ref.mlflow_run_id, RUN_STATE_TAG, PRUNED)

        if not (ref.holdable and self.releases.after_last(tag)):
            tag()

    def _settle_pruned(self, searcher: Searcher) -> None:
        """Trials pruned before this flow started (a re-run or activate after the flow died
        between the pruning and its tag): their runs end FINISHED with det.state PRUNED."""
        pruned = {str(t) for t in searcher.pruned()}
        if not pruned:
            return
        parent = self.runs.client.get_run(self.runs.parent_run_id)
        for run in trial_runs(self.runs.client, parent):
            if (
                run.data.tags.get(TRIAL_TAG) in pruned
                and run.data.tags.get(RUN_STATE_TAG) != PRUNED
            ):
                if run.info.status != "FINISHED":
                    self.runs.finish(run.info.run_id, "FINISHED", PRUNED)
                self.runs.client.set_tag(run.info.run_id, RUN_STATE_TAG, PRUNED)

    def _ref(self, work: Work) -> TrialRef:
        if work.trial_id not in self.refs:
            spec = TrialSpec(
                config_path=str(self.config_path),
                model_dir=str(self.model_path),
                overrides=tuple(self.overrides),
                trial_id=work.trial_id,
                hparams=work.hparams,
                experiment_run_key=self.run_key,
                config=self.entered,
            )
            run_id = self.runs.trial_run(
                str(work.trial_id),
                work.hparams,
                trial_run_tags(
                    self.raw, self.model_path.resolve(), self.cfg.reproducibility.experiment_seed
                ),
            )
            self.refs[work.trial_id] = TrialRef(
                spec=spec,
                parent_run_id=self.runs.parent_run_id,
                experiment_id=self.runs.experiment_id,
                mlflow_run_id=run_id,
                holdable=holdable(self.cfg) is None,
                package=self.package,
                gpus=self.cfg.resources.slots_per_trial if self.placement.gpus else 0,
                pool_resource=self.pool_resource,
            )
            self.table.add(work.trial_id, work.hparams, run_id)
        return self.refs[work.trial_id]


def resumed_at(client: Any, run_id: str, stop: int | None) -> int:
    """Where a trial this flow run has not trained yet starts: its latest checkpoint at or
    before ``stop``, which its worker restores (an activated experiment's trial goes on
    from its pause checkpoint); 0 without one."""
    steps = [int(r["steps_completed"]) for r in checkpoint_records(client, run_id)]
    return max((s for s in steps if stop is None or s <= stop), default=0)


STOPPED_BY = {
    "kill": "killed (no checkpoint) at batch {} by the experiment's stop request",
    "pause": "paused at batch {} by the experiment's stop request",
    "cancel": "canceled at batch {} by the experiment's stop request",
    PREEMPT: "preempted at batch {}: its slot went to more urgent work (det job list)",
}


def _end_cancelled(future: Any, result: StepResult) -> None:
    """A train task stopped on request ends Cancelled in Prefect, saying at which batch and
    why: Completed read as if it had trained its whole range."""
    how = STOPPED_BY.get(str(result.preempted), f"{result.preempted} at batch {{}}")
    message = how.format(result.position)
    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(future.task_run_id, Cancelled(message=message), force=True)
    except Exception as err:  # only what the UI shows is at stake
        get_run_logger().debug("could not mark the stopped task Cancelled: %s", err)


def _as_future(prefect_future: Any) -> Future[Any]:
    """A concurrent.futures view of a PrefectFuture, so one wait() covers all trials
    (ThreadPoolTaskRunner futures wrap a concurrent.futures.Future)."""
    wrapped = getattr(prefect_future, "wrapped_future", None)
    if isinstance(wrapped, Future):
        proxy: Future[Any] = Future()

        def _done(f: Future[Any]) -> None:
            try:
                proxy.set_result(prefect_future.result())
            except BaseException as err:  # surfaced by fut.result() in the flow
                proxy.set_exception(err)

        wrapped.add_done_callback(_done)
        return proxy
    proxy = Future()
    try:
        proxy.set_result(prefect_future.result())
    except BaseException as err:
        proxy.set_exception(err)
    return proxy
