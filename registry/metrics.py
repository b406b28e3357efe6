"""The MLflow metrics sink: asynchronous, batched, and exactly-once across outages.

The training thread only appends a report to an inbox, waking nobody; a background thread
collects the inbox every ``flush_interval_s`` (at once on flush/close, and between requests
while it has a backlog) and sends ``log_batch`` requests of at most 1000 metrics. So the
sender takes the GIL a few times a second, not once per report, however often training
reports. Reports stay as they came until the batch that sends them is built: a training
loop that reports faster than the server stores (50 metrics a batch, a thousand batches a
second, against a server storing a few thousand points a second) leaves a backlog, and the
sender spends its share of the GIL only on what it sends. Past a bound the backlog's
newest reports are pickled to disk, in order. When the server is unreachable, batches wait
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
import pickle
import threading
import time
import uuid as uuid_lib
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from registry.rest_session import RETRYABLE_STATUS, RestSession

__all__ = ["MlflowMetricsSink"]

log = logging.getLogger(__name__)
MAX_BATCH = 1000
CHUNK_POINTS = 10 * MAX_BATCH  # the backlog's unit of spilling: about 10 requests' worth

Point = tuple[str, float, int, int]  # key, value, timestamp (ms), step
Report = tuple[str, int, int, dict[str, Any]]  # group, step, timestamp (ms), metrics
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


def _is_number(value: Any) -> bool:
    """What becomes a metric point: ints and floats (numpy's too), not bools."""
    return type(value) is float or (isinstance(value, int | float) and not isinstance(value, bool))


class _Batch:
    def __init__(self, metrics: list[Point]) -> None:
        self.metrics = metrics
        self.uncertain = False  # a request for it failed: the server may hold some points


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
    ) -> None:
        self.client = client
        # (rank, ranks) of processes logging to this run: MLflow keeps one row per (key,
        # step, value, timestamp), so two ranks' equal reports in the same millisecond
        # would collapse into one; each rank's timestamps get their own residue mod ranks.
        self._rank, self._ranks = writer
        self.run_id = run_id
        self._over_http = str(client.tracking_uri).startswith(("http://", "https://"))
        self._rest = RestSession(str(client.tracking_uri)) if self._over_http else None
        # Highest step already stored per key: a retried trial resumes from its checkpoint
        # and re-reports the steps after it with identical values; those are not re-sent.
        self._stored_max: dict[str, int] = {}
        # Reports wait here until the sender's next pass. Appending wakes nobody: a sender
        # woken per report would take the GIL from training thousands of times a second.
        self._inbox: collections.deque[Report] = collections.deque()
        self._names: dict[str, dict[str, str]] = {}  # group -> key -> "group/key"
        # (group, the report's keys in order) -> their "group/key" names: a report whose
        # values are all floats becomes its points without a Python step per point.
        self._report_names: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}
        self._key_json: dict[str, str] = {}  # "group/key" -> its JSON string literal
        self._plain_keys: set[str] = set()  # keys whose JSON literal is "key" unescaped
        self._wake = threading.Event()  # flush() and close(): do not wait out the interval
        # The sender's queue, oldest first: chunks of reports, in memory or (a Path) pickled
        # to disk. Only the batch being sent is turned into points.
        self._backlog: collections.deque[collections.deque[Report] | Path] = collections.deque()
        self._backlog_points = 0  # metrics held in memory in the backlog
        self._current: _Batch | None = None  # being sent; retried until the server has it
        self._carry: list[Point] = []  # a report's points beyond the current batch
        self._spill_dir = spill_dir
        self._memory_limit = memory_limit
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
            self._inbox.append((group, step, now, metrics))

    def _points(self, report: Report) -> list[Point]:
        """The report's numeric values as points (bools and anything else are left out)."""
        group, step, now, metrics = report
        values = list(metrics.values())
        if set(map(type, values)) <= {float}:  # the common case, without a step per point
            names = self._report_names.get((group, tuple(metrics)))
            if names is None:
                if len(self._report_names) > _NAME_CACHE_LIMIT:  # keys that change per report
                    self._report_names.clear()
                names = tuple(self._name(group, k) for k in metrics)
                self._report_names[(group, tuple(metrics))] = names
            return list(zip(names, values, itertools.repeat(now), itertools.repeat(step)))
        points: list[Point] = []
        for k, v in metrics.items():
            if _is_number(v):
                points.append((self._name(group, k), float(v), now, step))
        return points

    def _name(self, group: str, key: str) -> str:
        """ "group/key", built once per key, not once per report."""
        names = self._names.get(group)
        if names is None:
            names = self._names[group] = {}
        name = names.get(key)
        if name is None:
            name = names[key] = f"{group}/{key}"
            if json.dumps(name) == f'"{name}"':
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
        if response.status_code in RETRYABLE_STATUS:
            response.raise_for_status()  # kept and retried, like an unreachable server
        # The server refused the batch itself (a 4xx): sending it again gets the same answer
        # and would hold up every later batch, so it is reported and dropped.
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
            self._absorb_inbox()
            if self._has_work():
                if self._send_one():
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
        """Every report enqueued so far onto the backlog, as they came, in chunks of about
        CHUNK_POINTS metrics (the unit that can be spilled)."""
        inbox = self._inbox
        chunk: collections.deque[Report] = collections.deque()
        held = 0
        for _ in range(len(inbox)):  # reports appended meanwhile wait for the next pass
            report = inbox.popleft()
            chunk.append(report)
            held += len(report[3])
            if held >= CHUNK_POINTS:
                self._backlog.append(chunk)
                self._backlog_points += held
                chunk, held = collections.deque(), 0
        if chunk:
            self._backlog.append(chunk)
            self._backlog_points += held
        self._spill_if_needed()

    def _drained(self) -> bool:
        return not self._inbox and not self._has_work() and self._idle.is_set()

    def _has_work(self) -> bool:
        return bool(self._current is not None or self._carry or self._backlog)

    def _next_batch(self) -> _Batch:
        """The batch being sent, or the next one, built from the oldest reports."""
        if self._current is not None:
            return self._current
        points, self._carry = self._carry, []
        backlog = self._backlog
        while len(points) < MAX_BATCH and backlog:
            head = backlog[0]
            if isinstance(head, Path):
                head = backlog[0] = self._read_spilled(head)
            while head and len(points) < MAX_BATCH:
                report = head.popleft()
                self._backlog_points -= len(report[3])
                points.extend(self._points(report))
            if not head:
                backlog.popleft()
        self._carry = points[MAX_BATCH:]
        self._current = _Batch(points[:MAX_BATCH])
        return self._current

    def _send_one(self) -> bool:
        batch = self._next_batch()
        try:
            if batch.uncertain:
                batch.metrics = self._not_yet_stored(batch.metrics)
            batch.metrics = self._after_stored(batch.metrics)
            if batch.metrics and self._log_batch(batch.metrics):
                self.sent_points += len(batch.metrics)
                self._note_stored(batch.metrics)
        except Exception as err:  # unreachable server, 5xx, timeouts: keep and retry
            self.failures += 1
            batch.uncertain = True
            log.warning(
                "MLflow unreachable (%s); about %d metric points waiting",
                type(err).__name__,
                len(batch.metrics) + len(self._carry) + self._backlog_points,
            )
            return False
        self._current = None
        return True

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

    def _spill_if_needed(self) -> None:
        """Past the memory bound, the newest chunks in memory go to disk (they are needed
        last); the oldest, which the next batches come from, stay. Pickled reports: the
        sender reads its own files back, and a report's values may be any type (only
        numeric ones become points, when sent)."""
        for index in range(len(self._backlog) - 1, 0, -1):
            if self._backlog_points <= self._memory_limit:
                return
            chunk = self._backlog[index]
            if isinstance(chunk, Path):
                continue
            self._spill_dir.mkdir(parents=True, exist_ok=True)
            path = self._spill_dir / f"{time.time_ns()}-{uuid_lib.uuid4().hex}.pkl"
            self._write(path, chunk)
            self._backlog[index] = path
            self._backlog_points -= sum(len(report[3]) for report in chunk)

    def _write(self, path: Path, chunk: collections.deque[Report]) -> None:
        try:
            data = pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a value that does not pickle: keep what would be sent of it
            numeric = collections.deque(
                (group, step, now, {k: float(v) for k, v in metrics.items() if _is_number(v)})
                for group, step, now, metrics in chunk
            )
            data = pickle.dumps(numeric, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)

    def _read_spilled(self, path: Path) -> collections.deque[Report]:
        chunk: collections.deque[Report] = pickle.loads(path.read_bytes())
        path.unlink(missing_ok=True)
        self._backlog_points += sum(len(report[3]) for report in chunk)
        return chunk

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
            waiting = len(self._carry) + self._backlog_points
            if self._current is not None:
                waiting += len(self._current.metrics)
            log.error(
                "MLflow did not come back within %.0fs: about %d metric points not sent, "
                "and %d chunks of reports on disk (spill directory %s)",
                self._close_timeout,
                waiting,
                sum(isinstance(chunk, Path) for chunk in self._backlog),
                self._spill_dir,
            )
