"""The `det-tasks run` progress bar: total, percentage, ETA, epoch, throughput and the last
loss; it follows the loop's batch counter between reports (a thread, not the loop)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from det_tasks.runner.in_process import run_trial
from det_tasks.runner.progress import ProgressSink

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"


def last_line(text: str) -> str:
    return re.split(r"[\r\n]", text.strip())[-1]


def test_bar_moves_between_reports_with_eta_epoch_and_loss(capsys):
    done = [0]
    bar = ProgressSink(total_batches=None, records_per_batch=8)
    bar.watch_progress(lambda: done[0], epoch_len=10, max_batches=200)  # total from the loop
    bar.report_training(20, {"loss": 0.5})
    done[0] = 50  # the loop moved on; no report since
    time.sleep(1.2)  # the bar's thread reads the counter at least once a second
    line = last_line(capsys.readouterr().err)
    assert re.search(r"\b50/200\b", line), line
    assert "25%" in line
    assert re.search(r"<\d\d:\d\d", line), line  # ETA
    assert "epoch=5.00" in line and "loss=0.5000" in line and "rec/s=" in line
    bar.close()


def test_run_trial_prints_total_and_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = run_trial(
        FLOW_MODEL / "killable.yaml",
        FLOW_MODEL,
        overrides=["hyperparameters.sleep_s=0"],
        max_batches=30,
        checkpoint_dir=tmp_path,
    )
    assert result.batches_trained == 30
    err = capsys.readouterr().err
    assert re.search(r"30/30 \[\d\d:\d\d<\d\d:\d\d", err), err
