"""The MLflow metrics sink: asynchronous, batched, and exactly-once across outages.

The training thread only appends a report to an inbox, waking nobody; a background thread
collects the inbox every ``flush_interval_s`` (at once on flush/close, and between requests
while it has a backlog) and sends ``log_batch`` requests of at most 1000 metrics. So the
sender takes the GIL a few times a second, not once per report, however often training
reports. When the
server is unreachable, batches wait in memory (spilled to disk past a bound) and are
retried with backoff; a batch whose request failed midway is first checked against the
server's metric history, so a point the server did store is not sent twice.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
import uuid as uuid_lib
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request

__all__ = ["MlflowMetricsSink"]

log = logging.getLogger(__name__)
MAX_BATCH = 1000
MAX_BATCH_BYTES = 900_000


Point = tuple[str, float, int, int]  # key, value, timestamp (ms), step
_ROW = '{"key": %s, "value": %s, "timestamp": %d, "step": %d}'


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
        self._host_creds = get_default_host_creds(client.tracking_uri)
        self._over_http = str(client.tracking_uri).startswith(("http://", "https://"))
        # Highest step already stored per key: a retried trial resumes from its checkpoint
        # and re-reports the steps after it with identical values; those are not re-sent.
        self._stored_max: dict[str, int] = {}
        # Reports wait here until the sender's next pass. Appending wakes nobody: a sender
        # woken per report would take the GIL from training thousands of times a second.
        self._inbox: collections.deque[tuple[str, int, int, dict[str, Any]]] = collections.deque()
        self._names: dict[str, dict[str, str]] = {}  # group -> key -> "group/key"
        self._key_json: dict[str, str] = {}  # "group/key" -> its JSON string literal
        self._wake = threading.Event()  # flush() and close(): do not wait out the interval
        self._pending: collections.deque[_Batch] = collections.deque()
        self._pending_points = 0
        self._spill_dir = spill_dir
        self._spilled: collections.deque[Path] = collections.deque()
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

    def _points(self, item: tuple[str, int, int, dict[str, Any]]) -> list[Point]:
        group, step, now, metrics = item
        names = self._names.get(group)
        if names is None:
            names = self._names[group] = {}
        points: list[Point] = []
        for k, v in metrics.items():
            if type(v) is float or (isinstance(v, int | float) and not isinstance(v, bool)):
                name = names.get(k)
                if name is None:  # "group/key" built once per key, not once per report
                    name = names[k] = f"{group}/{k}"
                points.append((name, float(v), now, step))
        return points

    def _log_batch(self, metrics: list[Point]) -> None:
        """POST runs/log-batch as plain JSON, with no client-side retries: the sink retries
        itself (and deduplicates), and skipping MLflow's protobuf round trip keeps the
        sender's share of the GIL small. A local store (the embedded mode's SQLite) has no
        HTTP endpoint: there the client writes it."""
        if not self._over_http:
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in metrics]
            )
            return
        http_request(
            self._host_creds,
            "/api/2.0/mlflow/runs/log-batch",
            "POST",
            max_retries=0,
            timeout=30,
            data=self._batch_json(metrics).encode(),
            extra_headers={"Content-Type": "application/json"},
        )

    def _batch_json(self, metrics: list[Point]) -> str:
        """The log-batch body, formatted per point from cached key literals: the text
        ``json.dumps`` gives for the same dicts (finite values), without building a dict
        per point, which took a third of the sender's time."""
        key_json = self._key_json
        rows = []
        for k, v, t, s in metrics:
            literal = key_json.get(k)
            if literal is None:
                literal = key_json[k] = json.dumps(k)
            rows.append(_ROW % (literal, _json_float(v), t, s))
        return f'{{"run_id": {json.dumps(self.run_id)}, "metrics": [{", ".join(rows)}]}}'

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
        """Every report enqueued so far, as batches of at most MAX_BATCH points."""
        points: list[Point] = []
        inbox = self._inbox
        while inbox:
            points.extend(self._points(inbox.popleft()))
        for start in range(0, len(points), MAX_BATCH):
            self._pending.append(_Batch(points[start : start + MAX_BATCH]))
            self._pending_points += len(points[start : start + MAX_BATCH])
        self._spill_if_needed()

    def _drained(self) -> bool:
        return not self._inbox and not self._has_work() and self._idle.is_set()

    def _has_work(self) -> bool:
        return bool(self._pending or self._spilled)

    def _next_batch(self) -> _Batch:
        if self._spilled:  # oldest first: spilled batches precede those in memory
            path = self._spilled[0]
            rows = json.loads(path.read_text())
            batch = _Batch([tuple(r) for r in rows["metrics"]])  # type: ignore[misc]
            batch.uncertain = rows["uncertain"]
            return batch
        return self._pending[0]

    def _send_one(self) -> bool:
        batch = self._next_batch()
        try:
            if batch.uncertain:
                batch.metrics = self._not_yet_stored(batch.metrics)
            batch.metrics = self._after_stored(batch.metrics)
            if batch.metrics:
                self._log_batch(batch.metrics)
                for key, _, _, step in batch.metrics:
                    self._stored_max[key] = max(self._stored_max[key], step)
        except Exception as err:  # unreachable server, 5xx, timeouts: keep and retry
            self.failures += 1
            batch.uncertain = True
            if self._spilled:
                self._rewrite_spilled(batch)
            log.warning(
                "MLflow unreachable (%s); %d metric batches waiting",
                type(err).__name__,
                len(self._pending) + len(self._spilled),
            )
            return False
        self.sent_points += len(batch.metrics)
        if self._spilled:
            self._spilled.popleft().unlink(missing_ok=True)
        else:
            self._pending.popleft()
            self._pending_points -= len(batch.metrics)
        return True

    def _after_stored(self, metrics: list[Point]) -> list[Point]:
        new_keys = {p[0] for p in metrics} - set(self._stored_max)
        if new_keys:
            self._learn_stored_steps(new_keys)
        return [p for p in metrics if p[3] > self._stored_max[p[0]]]

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
        while self._pending_points > self._memory_limit and len(self._pending) > 1:
            batch = self._pending.popleft()
            self._pending_points -= len(batch.metrics)
            self._spill_dir.mkdir(parents=True, exist_ok=True)
            path = self._spill_dir / f"{time.time_ns()}-{uuid_lib.uuid4().hex}.json"
            self._write(path, batch)
            self._spilled.append(path)

    def _rewrite_spilled(self, batch: _Batch) -> None:
        self._write(self._spilled[0], batch)

    @staticmethod
    def _write(path: Path, batch: _Batch) -> None:
        rows = {
            "uncertain": batch.uncertain,
            "metrics": [list(p) for p in batch.metrics],
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(path)

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
        if not done:
            waiting = len(self._pending) + len(self._spilled)
            log.error(
                "MLflow did not come back within %.0fs: %d metric batches not sent "
                "(spill directory %s)",
                self._close_timeout,
                waiting,
                self._spill_dir,
            )
