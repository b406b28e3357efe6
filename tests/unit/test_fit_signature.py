"""``Trainer.fit`` takes every keyword of Determined 0.38's, and each one does something."""

from __future__ import annotations

import inspect

from det_tasks import pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial

DETERMINED_038_FIT = [
    "checkpoint_period",
    "validation_period",
    "max_length",
    "reporting_period",
    "checkpoint_policy",
    "latest_checkpoint",
    "step_zero_validation",
    "test_mode",
    "profiling_enabled",
]


def test_fit_takes_determineds_keywords_in_order():
    params = list(inspect.signature(pytorch.Trainer.fit).parameters)[1:]
    assert params[: len(DETERMINED_038_FIT)] == DETERMINED_038_FIT


def test_profiling_enabled_reports_phase_timings_and_system_figures(tmp_path):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
        max_length=pytorch.Batch(5), checkpoint_policy="none", profiling_enabled=True
    )
    assert len(sink.profiling) == 1
    step, figures = sink.profiling[0]
    assert step == 5
    assert {"train_batch_ms", "dataloader_next_ms"} <= set(figures)
    assert 0.0 <= figures["cpu_util_percent"] <= 100.0 * 64
    assert figures["process_rss_gb"] > 0


def test_profiling_is_off_by_default(tmp_path):
    sink = InMemoryMetricsSink()
    ctx = pytorch.init(
        hparams={"learning_rate": 0.1, "global_batch_size": 4},
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path),
    )
    pytorch.Trainer(OneVarTrial(ctx), ctx).fit(
        max_length=pytorch.Batch(2), checkpoint_policy="none"
    )
    assert sink.profiling == []
