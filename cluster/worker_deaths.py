"""Why a Dask worker died under a trial's step, in the words a user acts on.

Dask reports a worker that died mid-task as ``KilledWorker: ... Inspecting worker logs is
often a good next step``: no exit code, no trial, and the worker's logs are gone with it.
The worker's Nanny (its parent) is the one that sees the exit code; it logs it at INFO
("Worker process 123 was killed by signal 9"). ``DeathRecorder``, a Nanny plugin registered
once per cluster, keeps those lines (the Nanny's logger may be set quieter than INFO, so it
takes them before that level applies and passes on only what was shown before), and
``explain_death`` asks every Nanny for them and builds the one line: trial, phase, batches,
exit code or signal, a likely cause, and the worker's last log lines where they are in a
file (a stack worker's log).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from distributed import Client, Nanny
from distributed.diagnostics.plugin import NannyPlugin

from cluster.environment import accepts
from cluster.held_trials import StepRequest
from det_tasks.errors import StepFailed
from det_tasks.exit_signals import signal_cause
from registry.runs.tracking import PARENT_TAG, TRIAL_TAG, client_for
from registry.servers.settings import RegistrySettings

__all__ = [
    "DEATHS_PLUGIN_NAME",
    "DeathRecorder",
    "death_cause",
    "explain_death",
    "reached_batch",
]

DEATHS_PLUGIN_NAME = "det-tasks-worker-deaths"
_NANNY_LOGGER = "distributed.nanny"
_DEATH = re.compile(
    r"Worker process (\d+) (?:exited with status (-?\d+)|was killed by signal (\d+))"
)
_KEPT = 32  # deaths remembered per Nanny
LOG_LINES = 20  # the worker's last log lines quoted


class _DeathLog(logging.Handler):
    """Keeps the Nanny's death lines; passes every record the logger showed before on.
    One per process, shared by the Nannies in it (an embedded cluster's all live in the
    flow's process): each one's setup would otherwise take the level the previous one set."""

    def __init__(self, shown_from: int) -> None:
        super().__init__(logging.DEBUG)
        self.deaths: collections.deque[dict[str, Any]] = collections.deque(maxlen=_KEPT)
        self.shown_from = shown_from
        self.users = 0  # Nannies of this process whose plugin uses it

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            found = _DEATH.search(record.getMessage())
            if found:
                pid, status, sig = found.groups()
                code = int(status) if status is not None else -int(sig)
                self.deaths.append({"pid": int(pid), "exitcode": code, "at": time.time()})
        if record.levelno >= self.shown_from and record.name.startswith(_NANNY_LOGGER):
            parent = logging.getLogger(_NANNY_LOGGER).parent
            if parent is not None:
                parent.handle(record)


def _process_death_log() -> _DeathLog | None:
    found = [h for h in logging.getLogger(_NANNY_LOGGER).handlers if isinstance(h, _DeathLog)]
    return found[0] if found else None


class DeathRecorder(NannyPlugin):
    """Records, in each Nanny's process, the exit codes of the worker processes lost."""

    name = DEATHS_PLUGIN_NAME
    idempotent = True  # once per cluster, whichever flow registers it first

    def setup(self, nanny: Nanny) -> None:
        logger = logging.getLogger(_NANNY_LOGGER)
        handler = _process_death_log()
        if handler is None:
            handler = _DeathLog(logger.getEffectiveLevel())
            logger.addHandler(handler)
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
            logger.propagate = False  # the handler passes on what was shown before
        handler.users += 1

    def teardown(self, nanny: Nanny) -> None:
        handler = _process_death_log()
        if handler is None:
            return
        handler.users -= 1
        if handler.users <= 0:
            logger = logging.getLogger(_NANNY_LOGGER)
            logger.removeHandler(handler)
            logger.setLevel(handler.shown_from)
            logger.propagate = True


def _nanny_report(dask_worker: Nanny) -> dict[str, Any]:
    """What this Nanny's process knows of worker deaths (``client.run(..., nanny=True)``);
    Nannies sharing a process share it."""
    handler = _process_death_log()
    deaths = list(handler.deaths) if handler is not None else []
    return {"name": str(dask_worker.name), "deaths": deaths, "log": _own_log_tail()}


def _own_log_tail(lines: int = LOG_LINES) -> list[str]:
    """The last lines of this process's standard error when it is a file (a stack
    worker's log, which its worker process writes to as well); else none."""
    with contextlib.suppress(OSError):
        target = Path(os.readlink("/proc/self/fd/2"))
        if target.is_file():
            with target.open("rb") as log:
                log.seek(max(0, target.stat().st_size - 64 * 1024))
                text = log.read().decode("utf-8", errors="replace")
            return text.splitlines()[-lines:]
    return []


def death_cause(exitcode: int | None) -> str:
    """The exit code or signal, and what most likely caused it."""
    if exitcode is None:
        return "its process ended (exit code unknown: its host or its Nanny went too?)"
    if exitcode < 0:
        return signal_cause(-exitcode)
    return (
        f"exited with code {exitcode}: the trial's code (or a library it calls) ended the "
        "process, e.g. os._exit()"
    )


PROGRESS_METRIC = "progress/batches"  # the harness's batches trained, at every report
REPORT_WAIT_S = 10.0  # for the Nanny to notice the death and start a fresh worker


def explain_death(client: Client, err: BaseException, request: StepRequest) -> StepFailed:
    """A ``StepFailed`` for ``request``, whose worker died (``err``: Dask's KilledWorker)."""
    last = getattr(err, "last_worker", None)
    name = str(getattr(last, "name", ""))
    nanny = getattr(last, "nanny", None)
    # A host that is gone has no Nanny left to report: not waited for (10 s of a lost
    # host's 11 s before its trial ran elsewhere, bench/hosts.py measured).
    waited = nanny is None or accepts(nanny)
    report = _report_of(client, name, time.time() - REPORT_WAIT_S) if waited else {}
    deaths, log = report.get("deaths", []), report.get("log", [])
    tail = ("; its last log lines:\n" + "\n".join(log)) if log else ""
    where = f" while training from batch {request.start}" if request.kind == "train" else ""
    cause = death_cause(deaths[-1]["exitcode"] if deaths else None)
    worker = name or str(getattr(last, "address", "") or "unknown")
    return StepFailed(
        request.trial.trial_id,
        request.kind,
        reached_batch(request) if request.kind == "train" else request.start,
        f"its Dask worker {worker} died{where}: {cause}{tail}",
    )


def reached_batch(request: StepRequest) -> int:
    """The batch the trial had reached when its worker died, as its MLflow run last heard
    (``progress/batches``, reported at every training report): not where the step began
    (a lost host's trial at batch 300-500 was reported "at batch 0"). The step's start
    when nothing more is known."""
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        return request.start
    with contextlib.suppress(Exception):  # the store unreachable: the start is still true
        client = client_for(settings.tracking_uri)
        tags = f"tags.`{TRIAL_TAG}` = '{request.trial.trial_id}'"
        runs = client.search_runs(
            [request.experiment_id],
            filter_string=f"{tags} and tags.`{PARENT_TAG}` = '{request.parent_run_id}'",
            max_results=1,
        )
        if runs:
            reported = int(runs[0].data.metrics.get(PROGRESS_METRIC, 0))
            return max(request.start, reported)
    return request.start


def _report_of(client: Client, name: str, since: float) -> dict[str, Any]:
    """The Nanny of worker ``name``'s report once it names a death after ``since``. Dask
    reaches a Nanny through its worker's registration, so this waits for the fresh worker
    (REPORT_WAIT_S at most: a host that is gone has no Nanny to answer)."""
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        reports: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            reports = client.run(_nanny_report, nanny=True, on_error="return")
        for report in reports.values():
            named = isinstance(report, dict) and report.get("name") == name
            if named and any(d["at"] >= since for d in report["deaths"]):
                return report
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.25)
