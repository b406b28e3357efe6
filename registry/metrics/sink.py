"""The MLflow metrics sink: asynchronous, batched, and exactly-once across outages.

The training thread only appends a report to an inbox, waking nobody; a background thread
collects the inbox every ``flush_interval_s`` (at once on flush/close, and between requests
while it has a backlog) and sends ``log_batch`` requests of at most 1000 metrics. So the
sender takes the GIL a few times a second, not once per report, however often training
reports. Reports stay as they came until the batch that sends them is built: a training
loop that reports faster than the server stores (50 metrics a batch, a thousand batches a
second, against a server storing a few thousand points a second) leaves a backlog, and the
sender spends its share of the GIL only on what it sends (registry.metrics.report_backlog keeps
them, in order, spilling to disk past a bound). When the server is unreachable, batches wait
and are retried with backoff; a batch whose request failed midway is first checked against
the server's metric history, so a point the server did store is not sent twice.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import operator
import re
import threading
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from registry.metrics.report_backlog import Report, ReportBacklog, numeric_metrics
from registry.runs.run_lease import RunLease
from registry.runs.trial_states import Progress
from registry.servers.mlflow_internals import metric_name_problem
from registry.servers.rest_session import AUTH_STATUS, RETRYABLE_STATUS, RestSession

__all__ = ["MlflowMetricsSink"]

log = logging.getLogger(__name__)
MAX_BATCH = 1000

Point = tuple[str, float, int, int]  # key, value, timestamp (ms), step
_ROW = '{"key": %s, "value": %s, "timestamp": %d, "step": %d}'
# A point whose key needs no JSON escaping and whose value is finite, formatted in one step:
# the same text as _ROW with json.dumps(key) and _json_float(value).
_PLAIN_ROW = '{"key": "%s", "value": %r, "timestamp": %d, "step": %d}'
_KEY = operator.itemgetter(0)
_VALUE = operator.itemgetter(1)
_STEP = operator.itemgetter(3)
_NAME_CACHE_LIMIT = 10_000


def _json_float(value: float) -> str:
    """A float as MLflow's protobuf JSON spells it: ``repr`` (what ``json.dumps`` writes),
    and NaN and infinities as the strings "NaN", "Infinity", "-Infinity" (plain JSON has no
    such numbers: requests refused them, and a batch holding one was retried forever)."""
    if value != value:
        return '"NaN"'
    if value in (math.inf, -math.inf):
        return '"Infinity"' if value > 0 else '"-Infinity"'
    return repr(value)


class _Batch:
    def __init__(self, metrics: list[Point], reports_through: int) -> None:
        self.metrics = metrics
        self.uncertain = False  # a request for it failed: the server may hold some points
        self.reports_through = reports_through  # once sent, every report up to this is


class MlflowMetricsSink:
    """MetricsSink over one MLflow run (a trial's child run)."""

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        *,
        spill_dir: Path,
        memory_limit: int = 200_000,
        flush_interval_s: float = 2.0,
        close_timeout_s: float = 120.0,
        writer: tuple[int, int] = (0, 1),
        lease: RunLease | None = None,
    ) -> None:
        self.client = client
        # Fencing (registry.runs.run_lease): once another process holds the run, only points up
        # to the newest checkpoint this one recorded are still sent.
        self._lease = lease
        # (rank, ranks) of processes logging to this run: MLflow keeps one row per (key,
        # step, value, timestamp), so two ranks' equal reports in the same millisecond
        # would collapse into one; each rank's timestamps get their own residue mod ranks.
        self._rank, self._ranks = writer
        self.run_id = run_id
        over_http = str(client.tracking_uri).startswith(("http://", "https://"))
        # None: a local store (the embedded mode's SQLite), written through the client.
        self._rest = RestSession(str(client.tracking_uri)) if over_http else None
        # Highest step already stored per key: a retried trial resumes from its checkpoint
        # and re-reports the steps after it with identical values; those are not re-sent.
        self._stored_max: dict[str, int] = {}
        # How far the trial got (the loop tells it: det_tasks.sinks.record_position_on);
        # the run's end reads it to decide whether the trial may be COMPLETED.
        self.position: Progress | None = None
        # Reports wait here until the sender's next pass. Appending wakes nobody: a sender
        # woken per report would take the GIL from training thousands of times a second.
        self._inbox: collections.deque[Report] = collections.deque()
        self._names: dict[str, dict[str, str | None]] = {}  # group -> key -> "group/key"
        # (group, the report's keys in order) -> their "group/key" names: a report whose
        # values are all floats becomes its points without a Python step per point.
        self._report_names: dict[tuple[str, tuple[str, ...]], tuple[str, ...] | None] = {}
        self._key_json: dict[str, str] = {}  # "group/key" -> its JSON string literal
        self._plain_keys: set[str] = set()  # keys whose JSON literal is "key" unescaped
        self._wake = threading.Event()  # flush() and close(): do not wait out the interval
        # The sender's queue, oldest first; only the batch being sent is turned into points.
        self._backlog = ReportBacklog(spill_dir, memory_limit)
        self._current: _Batch | None = None  # being sent; retried until the server has it
        self._carry: list[Point] = []  # a report's points beyond the current batch
        self._spill_dir = spill_dir
        self._flush_interval = flush_interval_s
        self._close_timeout = close_timeout_s
        self._closed = threading.Event()
        self._flushing = threading.Event()  # set: send now instead of coalescing
        self._idle = threading.Event()
        self._state_lock = threading.Lock()
        self._idle.set()
        self.sent_points = 0
        self.failures = 0
        self.rejected_points = 0  # the server refused them (4xx): logged, not retried
        # Reports counted as they are enqueued, taken into batches, and done (stored, or
        # settled otherwise: refused, fenced): what ``mark`` and ``wait_sent`` compare.
        self._enqueued = self._popped = self._sent_through = 0
        self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self._thread.start()

    # ---- MetricsSink (called on the training thread: enqueue only) ---------------------
    def report_training(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self._enqueue("training", steps_completed, metrics)

    def report_validation(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self._enqueue("validation", steps_completed, metrics)

    def report_progress(self, steps_completed: int, epochs: float) -> None:
        self._enqueue("progress", steps_completed, {"batches": steps_completed, "epochs": epochs})

    def report_checkpoint(self, steps_completed: int, uuid: str, metadata: dict[str, Any]) -> None:
        """Recorded by the checkpoint store once the bytes are uploaded."""

    def report_profiling(self, steps_completed: int, timings_ms: dict[str, float]) -> None:
        self._enqueue("profiling", steps_completed, timings_ms)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Any group (``group/name`` keys): Determined's ``core.train.report_metrics``."""
        self._enqueue(group, steps_completed, metrics)

    def _enqueue(self, group: str, step: int, metrics: dict[str, Any]) -> None:
        # O(1) on the training thread and no wake-up: the sender collects every
        # flush_interval (or when a request returns), and builds the points itself.
        with self._state_lock:
            self._idle.clear()
            now = int(time.time() * 1000)
            now += self._rank - now % self._ranks
            # A copy: the caller may reuse its dict, and this one waits until it is sent.
            self._inbox.append((group, step, now, dict(metrics)))
            self._enqueued += 1

    def _points(self, report: Report) -> list[Point]:
        """The report's numeric values as points (bools and anything else are left out, as
        are keys MLflow would refuse)."""
        group, step, now, metrics = report
        values = list(metrics.values())
        if set(map(type, values)) <= {float}:  # the common case, without a step per point
            keys = tuple(metrics)
            if (group, keys) in self._report_names:
                names = self._report_names[(group, keys)]
            else:
                if len(self._report_names) > _NAME_CACHE_LIMIT:  # keys that change per report
                    self._report_names.clear()
                valid = [n for n in (self._name(group, k) for k in keys) if n is not None]
                # None: a key MLflow refuses is among them; such reports take the slow path.
                names = tuple(valid) if len(valid) == len(keys) else None
                self._report_names[(group, keys)] = names
            if names is not None:
                return list(zip(names, values, itertools.repeat(now), itertools.repeat(step)))
        points: list[Point] = []
        for k, v in numeric_metrics(metrics).items():
            name = self._name(group, k)
            if name is not None:
                points.append((name, v, now, step))
        return points

    def _name(self, group: str, key: str) -> str | None:
        """ "group/key", built once per key, not once per report; None for a name MLflow
        refuses (the server would refuse the whole batch it is in)."""
        names = self._names.get(group)
        if names is None:
            names = self._names[group] = {}
        if key in names:
            return names[key]
        full = f"{group}/{key}"
        name: str | None = full
        problem = metric_name_problem(full)
        if problem is not None:
            name = _recordable(full, problem)
        names[key] = name
        if name is not None and json.dumps(name) == f'"{name}"':
            self._plain_keys.add(name)
        return name

    def _log_batch(self, metrics: list[Point]) -> bool:
        """POST runs/log-batch as plain JSON over the sink's kept session, with no
        client-side retries: the sink retries itself (and deduplicates), and skipping
        MLflow's protobuf round trip and per-request setup keeps the sender's share of the
        GIL small. A local store (the embedded mode's SQLite) has no HTTP endpoint: there
        the client writes it."""
        if self._rest is None:
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in metrics]
            )
            return True
        response = self._rest.post(
            "/api/2.0/mlflow/runs/log-batch", self._batch_json(metrics).encode()
        )
        if response.ok:
            return True
        if response.status_code in AUTH_STATUS:
            # Credentials can change under a long run (a rotated token): read them again.
            self._rest.close()
            self._rest = RestSession(str(self.client.tracking_uri))
        if response.status_code in RETRYABLE_STATUS or response.status_code in AUTH_STATUS:
            response.raise_for_status()  # kept and retried, like an unreachable server
        # The server refused the batch itself (any other 4xx): sending it again gets the same
        # answer and would hold up every later batch, so it is reported and dropped.
        self.rejected_points += len(metrics)
        log.error(
            "MLflow refused %d metric points for run %s (HTTP %d): %s",
            len(metrics),
            self.run_id,
            response.status_code,
            response.text[:500],
        )
        return False

    def _batch_json(self, metrics: list[Point]) -> str:
        """The log-batch body: the text ``json.dumps`` gives for the same dicts, with
        MLflow's spellings of NaN and infinities. A batch of plain keys and finite values
        (nearly every batch) is formatted in one pass in C; the rest per point from
        cached key literals."""
        if self._plain_keys.issuperset(map(_KEY, metrics)) and all(
            map(math.isfinite, map(_VALUE, metrics))
        ):
            rows = ", ".join(map(_PLAIN_ROW.__mod__, metrics))
        else:
            key_json = self._key_json
            parts = []
            for k, v, t, s in metrics:
                literal = key_json.get(k)
                if literal is None:
                    literal = key_json[k] = json.dumps(k)
                parts.append(_ROW % (literal, _json_float(v), t, s))
            rows = ", ".join(parts)
        return f'{{"run_id": {json.dumps(self.run_id)}, "metrics": [{rows}]}}'

    # ---- background sending -------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.5
        while True:
            self._mark_idle_if_drained()
            if self._closed.is_set() and self._idle.is_set():
                return
            urgent = self._flushing.is_set() or self._closed.is_set()
            if not self._has_work() and not (urgent and self._inbox):
                # Coalesce: one pass per interval turns many reports into few requests.
                self._wake.wait(timeout=self._flush_interval)
                self._wake.clear()
            try:
                self._absorb_inbox()
                sent = self._send_one() if self._has_work() else True
            except Exception:  # a bug must not end the sender: what waits would never go
                log.exception("the MLflow metrics sender failed; retrying")
                sent = False
            if sent:
                backoff = 0.5
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def _mark_idle_if_drained(self) -> None:
        # Under the lock enqueue uses, so "idle" never hides a report that is in flight.
        with self._state_lock:
            if not self._has_work() and not self._inbox:
                self._idle.set()

    def _absorb_inbox(self) -> None:
        """Every report enqueued so far onto the backlog, as they came."""
        inbox = self._inbox
        # Reports appended meanwhile wait for the next pass.
        self._backlog.extend(inbox.popleft() for _ in range(len(inbox)))

    def _drained(self) -> bool:
        return not self._inbox and not self._has_work() and self._idle.is_set()

    def _has_work(self) -> bool:
        return bool(self._current is not None or self._carry or self._backlog)

    def _next_batch(self) -> _Batch:
        """The batch being sent, or the next one, built from the oldest reports."""
        if self._current is not None:
            return self._current
        points, self._carry = self._carry, []
        while len(points) < MAX_BATCH and (report := self._backlog.popleft()) is not None:
            points.extend(self._points(report))
            self._popped += 1
        self._carry = points[MAX_BATCH:]
        # A report whose points run past this batch is done only with the next one.
        through = self._popped - 1 if self._carry else self._popped
        self._current = _Batch(points[:MAX_BATCH], through)
        return self._current

    def _send_one(self) -> bool:
        batch = self._next_batch()
        try:
            if batch.uncertain:
                batch.metrics = self._not_yet_stored(batch.metrics)
            batch.metrics = self._after_stored(batch.metrics)
            if batch.metrics and self._lease is not None:
                batch.metrics = self._unfenced(batch.metrics)
            if batch.metrics and self._log_batch(batch.metrics):
                self.sent_points += len(batch.metrics)
                self._note_stored(batch.metrics)
        except Exception as err:  # unreachable server, 5xx, timeouts: keep and retry
            self.failures += 1
            batch.uncertain = True
            log.warning(
                "MLflow unreachable (%s); about %d metric points waiting",
                type(err).__name__,
                len(batch.metrics) + len(self._carry) + self._backlog.held_points,
            )
            return False
        self._sent_through = batch.reports_through
        self._current = None
        return True

    def _unfenced(self, metrics: list[Point]) -> list[Point]:
        """``metrics`` while this process holds the run (asked right before the write).
        Once another holds it, only the points up to the newest checkpoint this process
        recorded: the new holder resumed from there at the latest and reports everything
        after it itself (its own records are newer than anything of this one's)."""
        assert self._lease is not None
        if self._lease.held():
            return metrics
        return [p for p in metrics if p[3] <= self._lease.recorded_through]

    def _note_stored(self, metrics: list[Point]) -> None:
        stored_max = self._stored_max
        steps = list(map(_STEP, metrics))
        if steps == sorted(steps):  # reports in step order: each key's last step is its max
            for key, step in dict(zip(map(_KEY, metrics), steps, strict=True)).items():
                if step > stored_max[key]:
                    stored_max[key] = step
            return
        for key, _, _, step in metrics:
            stored_max[key] = max(stored_max[key], step)

    def _after_stored(self, metrics: list[Point]) -> list[Point]:
        keys = set(map(_KEY, metrics))
        new_keys = keys.difference(self._stored_max)
        if new_keys:
            self._learn_stored_steps(new_keys)
        if not metrics:
            return metrics
        stored_max = self._stored_max
        if min(map(_STEP, metrics)) > max(stored_max[k] for k in keys):
            return metrics  # every point is past what the run holds: nothing to drop
        return [p for p in metrics if p[3] > stored_max[p[0]]]

    def _learn_stored_steps(self, keys: set[str]) -> None:
        """Each key's highest step this writer already stored, -1 for none. One get_run
        names the keys the run holds any point of; only those need their history read, so
        a fresh run's first batch costs one request, not one per key (50 keys: 50 requests,
        a quarter of a short trial's sender time, all while training). Only this writer's
        points count (its timestamp residue): another rank's report of the same step is its
        own record, not a copy of this one."""
        logged = self.client.get_run(self.run_id).data.metrics
        for key in keys:
            if key not in logged:
                self._stored_max[key] = -1
                continue
            history = self.client.get_metric_history(self.run_id, key)
            self._stored_max[key] = max(
                (m.step for m in history if m.timestamp % self._ranks == self._rank), default=-1
            )

    def _not_yet_stored(self, metrics: list[Point]) -> list[Point]:
        stored = set()
        for key in {p[0] for p in metrics}:
            for m in self.client.get_metric_history(self.run_id, key):
                stored.add((m.key, m.value, m.timestamp, m.step))
        return [p for p in metrics if p not in stored]

    # ---- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything enqueued so far has reached the server."""
        if not self._thread.is_alive():  # closed already: nothing can be sent any more
            return not self._has_work() and not self._inbox
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._close_timeout)
        self._flushing.set()
        self._wake.set()
        try:
            while True:
                if self._drained():
                    return True
                if not self._thread.is_alive():  # the sender died: nothing will drain
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Woken the moment the sender marks itself idle (a 50 ms poll was most of a
                # trial's end); a report enqueued meanwhile clears it again.
                if self._idle.wait(min(remaining, 1.0)) and not self._drained():
                    time.sleep(0.001)
        finally:
            self._flushing.clear()

    def mark(self) -> int:
        """A mark for everything reported so far (``wait_sent`` waits for it)."""
        return self._enqueued

    def wait_sent(self, mark: int, timeout_s: float) -> bool:
        """Wait until every report up to ``mark`` is settled (stored, or refused or fenced),
        sending now instead of at the next interval; False after ``timeout_s``. A checkpoint
        is recorded only after its metrics: a worker lost after the record would otherwise
        take the unsent ones with it, and whoever resumes from that checkpoint never
        reports them again."""
        deadline = time.monotonic() + timeout_s
        self._flushing.set()
        self._wake.set()
        try:
            while self._sent_through < mark:
                if not self._thread.is_alive() or time.monotonic() >= deadline:
                    return False
                self._wake.set()
                time.sleep(0.01)
            return True
        finally:
            self._flushing.clear()

    def record_position(self, trained: int, length: int | None, stop_requested: bool) -> None:
        """Where the trial's loop stands (see ``position``)."""
        self.position = Progress(trained, length, stop_requested)

    def close(self) -> None:
        if self._closed.is_set():  # idempotent: the runner and the services may both close
            return
        done = self.flush()
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._rest is not None and not self._thread.is_alive():
            self._rest.close()
        if not done:
            waiting = len(self._carry) + self._backlog.held_points
            if self._current is not None:
                waiting += len(self._current.metrics)
            log.error(
                "MLflow did not come back within %.0fs: about %d metric points not sent, "
                "and %d chunks of reports on disk (spill directory %s)",
                self._close_timeout,
                waiting,
                self._backlog.spilled_chunks,
                self._spill_dir,
            )


# Characters MLflow 3.17 takes in a metric name (mlflow.utils.validation's param/metric rule).
_REFUSED_IN_NAMES = re.compile(r"[^\w.\- :/]")


def _recordable(name: str, why: str) -> str | None:
    """A name MLflow refuses (Determined takes any: ``recall@1``), recorded with each
    refused character as ``_``, said once; None if even that is refused."""
    cleaned = _REFUSED_IN_NAMES.sub("_", name)
    if metric_name_problem(cleaned) is not None:
        log.error("metric %r is not recorded: %s", name, why)
        return None
    log.warning("metric %r is recorded as %r: MLflow refuses its name (%s)", name, cleaned, why)
    return cleaned
