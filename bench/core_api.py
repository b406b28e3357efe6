"""The Core API's own cost (issue 52's bench), against the same work through a PyTorchTrial.

- report: ``core_context.train.report_training_metrics`` with 10 metrics, against the sink
  calls a PyTorchTrial's loop makes for one training report (``report_training`` and
  ``report_progress``), both into an in-memory sink: what the Core API adds per report.
- checkpoint: ``store_path`` of a 10 MB state (``torch.save`` into the folder, sealed and
  published), against a PyTorchTrial's checkpoint writer storing the same state (its
  ``CheckpointWriter``, waited for until published), both into a local folder.

Interleaved (one of each per round), median of ``--rounds``; one line per figure, with the
host's load beside it (on a shared machine compare only figures from the same run).

    python bench/core_api.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from det_tasks import core
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch.harness import CheckpointFiles, CheckpointWriter
from det_tasks.sinks import InMemoryMetricsSink

REPORTS = 2_000
METRICS = {f"metric_{i}": float(i) for i in range(10)}
STATE = {"weights": torch.randn(10 * 2**20 // 4)}  # 10 MB of float32


def _core_reports(folder: Path) -> float:
    with core.init(checkpoint_storage=str(folder)) as context:
        report = context.train.report_training_metrics
        started = time.perf_counter()
        for step in range(1, REPORTS + 1):
            report(step, METRICS)
        return (time.perf_counter() - started) / REPORTS


def _trial_reports() -> float:
    sink = InMemoryMetricsSink()
    progress = getattr(sink, "report_progress", lambda *_: None)
    started = time.perf_counter()
    for step in range(1, REPORTS + 1):
        sink.report_training(step, METRICS)
        progress(step, 0.0)
    return (time.perf_counter() - started) / REPORTS


def _core_checkpoint(folder: Path) -> float:
    with core.init(checkpoint_storage=str(folder)) as context:
        started = time.perf_counter()
        with context.checkpoint.store_path({"steps_completed": 1}) as (path, _):
            torch.save(STATE, path / "state_dict.pth")
        return time.perf_counter() - started


def _trial_checkpoint(folder: Path) -> float:
    writer = CheckpointWriter(LocalDirectoryStore(folder), torch.device("cpu"))
    files = CheckpointFiles(load_data={}, model_dir=None, metadata={"steps_completed": 1})
    started = time.perf_counter()
    writer.save(STATE, files, [], None)
    writer.finished(wait=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {
        k: [] for k in ("core_rep", "trial_rep", "core_ck", "trial_ck")
    }
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            folder = Path(tmp) / str(index)
            times["core_rep"].append(_core_reports(folder / "r"))
            times["trial_rep"].append(_trial_reports())
            times["core_ck"].append(_core_checkpoint(folder / "core"))
            times["trial_ck"].append(_trial_checkpoint(folder / "trial"))
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0]
    print(f"core report, 10 metrics: {med['core_rep'] * 1e6:.1f} us; PyTorchTrial sink calls "
          f"{med['trial_rep'] * 1e6:.1f} us; ratio {med['core_rep'] / med['trial_rep']:.2f}x "
          f"(load {load:.1f})")  # fmt: skip
    print(f"core store_path, 10 MB: {med['core_ck'] * 1e3:.1f} ms; PyTorchTrial writer "
          f"{med['trial_ck'] * 1e3:.1f} ms; ratio {med['core_ck'] / med['trial_ck']:.2f}x "
          f"(load {load:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
