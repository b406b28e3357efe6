"""The job queue knows an experiment from ``det experiment create`` on (issue 53, item 4):
a grid of short trials holds the stack's 2 workers; a 1-trial experiment created beside it
is listed by ``det job list`` at once, and the first slot that frees after its creation is
kept for it while its flow run is still being picked up and started. Until its trial
trains, the grid never again holds both workers (before, every slot that freed went to the
grid, and the newcomer started after the grid's 5th trial)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra.stack import deploy
from tests.integration.helpers import FLOW_MODEL, flow_experiment, wait_for

DET = str(Path(sys.executable).with_name("det"))
GRID_BATCHES = 60  # 0.1 s a batch: each grid trial trains ~6 s, less than a flow's start
REPORT = "scheduling_unit=3"  # training metrics every 3 batches: when a trial trained


def _det(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DET, *args], capture_output=True, text=True, timeout=120, cwd=FLOW_MODEL)


def _training(client: Any, name: str) -> dict[str, tuple[int, int]]:
    """Each trial of experiment ``name``: (first, last) timestamp of its training loss, ms."""
    experiment = client.get_experiment_by_name(name)
    spans = {}
    for run in client.search_runs([experiment.experiment_id]):
        if "mlflow.parentRunId" not in run.data.tags:
            continue
        points = client.get_metric_history(run.info.run_id, "training/loss")
        if points:
            stamps = [p.timestamp for p in points]
            spans[run.data.tags["det.trial_id"]] = (min(stamps), max(stamps))
    return spans


def _most_at_once(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """How many of ``spans`` ran at once at most, within [start, end]."""
    edges = sorted(
        [(max(a, start), 1) for a, b in spans if a < end and b > start]
        + [(min(b, end), -1) for a, b in spans if a < end and b > start],
        key=lambda edge: (edge[0], edge[1]),
    )
    most = held = 0
    for _, step in edges:
        held += step
        most = max(most, held)
    return most


def test_an_experiment_is_queued_at_create_and_takes_the_next_freed_slot(
    stack, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    from registry.runs.tracking import client_for

    deploy(stack)
    pids = tmp_path / "pids"
    grid = flow_experiment(
        "grid.yaml",
        "name=fair-grid",
        "hyperparameters.hidden={type: categorical, vals: [3, 4, 5, 6]}",  # 8 trials, 2 at once
        "hyperparameters.sleep_s=0.1",
        f"searcher.max_length.batches={GRID_BATCHES}",
        f"data.pid_file={pids}",
        REPORT,
    )
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) >= 2, 300, "grid on both")
    created = _det("experiment", "create", "killable.yaml", ".", "--config", "name=fair-single",
                   "--config", "hyperparameters.sleep_s=0",
                   "--config", "searcher.max_length.batches=20", "--config", REPORT)  # fmt: skip
    created_ms = int(time.time() * 1000)
    assert created.returncode == 0, created.stderr[-3000:]
    short = re.search(r"Created experiment (\w+)", created.stdout).group(1)  # type: ignore[union-attr]
    listing = _det("job", "list")
    assert listing.returncode == 0, listing.stderr
    row = next(line.split() for line in listing.stdout.splitlines() if short in line)
    assert "fair-single" in row and "42" in row  # queued with its priority, flow or not

    _, grid_err = grid.communicate(timeout=600)
    assert grid.returncode == 0, grid_err[-3000:]
    waited = _det("experiment", "wait", short, "--polling-interval", "1")
    assert waited.returncode == 0, waited.stdout + waited.stderr

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    grid_spans = _training(client, "fair-grid")
    ((single_start, _),) = _training(client, "fair-single").values()
    assert len(grid_spans) == 8
    first_freed = min(end for _, end in grid_spans.values() if end > created_ms)
    # The scenario: the newcomer's flow was still starting when the grid's first slot freed.
    assert single_start > first_freed, (created_ms, first_freed, single_start)
    # From then until the newcomer trained, that slot stayed kept for it.
    assert _most_at_once(list(grid_spans.values()), first_freed, single_start) == 1, grid_spans
    started_before = sorted(a for a, _ in grid_spans.values() if a < single_start)
    assert len(started_before) < 8, "the newcomer waited for the whole grid"
