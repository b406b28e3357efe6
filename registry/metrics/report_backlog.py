"""A metrics sink's reports waiting to be sent: oldest first, bounded in memory.

Reports stay as they came (the sink copies each one when it is made) until the batch that
sends them is built, so a training loop that reports faster than the server stores costs
the sender only what it sends. Past ``memory_limit`` metrics, the newest chunks in memory
go to disk, data only (marshal: names, numbers, no objects), and are read back when they
reach the head. Order is kept throughout: the sink skips points at or below a key's highest
stored step, so a later batch sent first would make it drop earlier ones.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import marshal
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CHUNK_POINTS", "Report", "ReportBacklog", "numeric_metrics"]

log = logging.getLogger(__name__)

Report = tuple[str, int, int, dict[str, Any]]  # group, step, timestamp (ms), metrics
CHUNK_POINTS = 10_000  # the unit of spilling: about 10 requests' worth of metrics


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that become points: real numbers (numpy's too), not bools, as floats."""
    kept = {}
    for key, value in metrics.items():
        if type(value) is float:
            kept[key] = value
        elif (isinstance(value, int | float) and not isinstance(value, bool)) or _is_numpy_real(
            value
        ):
            try:
                kept[key] = float(value)
            except (OverflowError, ValueError, TypeError):
                log.warning("metric %r: %r is not a float; not recorded", key, value)
    return kept


def _is_numpy_real(value: Any) -> bool:
    kind = getattr(type(value), "__module__", "")
    return kind == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "fiu"


@dataclasses.dataclass
class _Chunk:
    reports: collections.deque[Report] | None  # None: on disk at ``path``
    points: int  # metrics in it, counted once when it was made
    path: Path | None = None


class ReportBacklog:
    """FIFO of reports in chunks of about CHUNK_POINTS metrics; see the module docstring."""

    def __init__(self, spill_dir: Path, memory_limit: int) -> None:
        self._spill_dir = spill_dir
        self._memory_limit = memory_limit
        self._chunks: collections.deque[_Chunk] = collections.deque()
        self.held_points = 0  # metrics in memory
        self.lost_points = 0  # in a spilled chunk that could not be read back

    def __bool__(self) -> bool:
        return bool(self._chunks)

    @property
    def spilled_chunks(self) -> int:
        return sum(chunk.reports is None for chunk in self._chunks)

    def extend(self, reports: Iterable[Report]) -> None:
        chunk: collections.deque[Report] = collections.deque()
        held = 0
        for report in reports:
            chunk.append(report)
            held += len(report[3])
            if held >= CHUNK_POINTS:
                self._add(chunk, held)
                chunk, held = collections.deque(), 0
        if chunk:
            self._add(chunk, held)
        self._spill_if_needed()

    def popleft(self) -> Report | None:
        """The oldest report, or None when there is none."""
        while self._chunks:
            head = self._chunks[0]
            if head.reports is None and not self._read_back(head):
                self._chunks.popleft()
                continue
            assert head.reports is not None
            if head.reports:
                report = head.reports.popleft()
                self.held_points -= len(report[3])
                if not head.reports:
                    self._chunks.popleft()
                return report
            self._chunks.popleft()
        return None

    def _add(self, reports: collections.deque[Report], points: int) -> None:
        self._chunks.append(_Chunk(reports, points))
        self.held_points += points

    def _spill_if_needed(self) -> None:
        """The newest chunks in memory go first (they are needed last); the head, which
        the next batches come from, stays."""
        for index in range(len(self._chunks) - 1, 0, -1):
            if self.held_points <= self._memory_limit:
                return
            chunk = self._chunks[index]
            if chunk.reports is None:
                continue
            path = self._spill_dir / f"{time.time_ns()}-{uuid.uuid4().hex}.reports"
            rows = [(g, s, t, numeric_metrics(m)) for g, s, t, m in chunk.reports]
            try:
                self._spill_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(marshal.dumps(rows))
                tmp.replace(path)
            except OSError as err:  # a full or read-only disk: keep it in memory
                log.warning("could not spill metrics to %s (%s); keeping them in memory", path, err)
                return
            self.held_points -= chunk.points
            chunk.reports, chunk.path = None, path

    def _read_back(self, chunk: _Chunk) -> bool:
        assert chunk.path is not None
        try:
            rows = marshal.loads(chunk.path.read_bytes())
        except (OSError, ValueError, EOFError, TypeError) as err:
            self.lost_points += chunk.points
            log.error(
                "spilled metrics %s could not be read back (%s): %d metric points lost",
                chunk.path,
                err,
                chunk.points,
            )
            return False
        chunk.path.unlink(missing_ok=True)
        chunk.reports = collections.deque(tuple(row) for row in rows)
        chunk.path = None
        self.held_points += sum(len(report[3]) for report in chunk.reports)
        return True
