"""The trial runs' system-metrics sampler on a real MLflow store (SQLite, no server): every
run gets a point, even one shorter than the interval, and a later sampler on the same run
(a promoted or restored trial) continues its steps; the default interval is 1 s."""

from __future__ import annotations

import time
from pathlib import Path

from registry.metrics.system_metrics import start_system_metrics
from registry.runs.tracking import client_for
from registry.servers.settings import DEFAULT_SYSTEM_METRICS_INTERVAL_S, RegistrySettings

KEY = "system/cpu_utilization_percentage"


def _settings(tmp_path: Path, interval: float) -> RegistrySettings:
    return RegistrySettings(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        s3_endpoint=None,
        bucket=None,
        artifacts_destination=None,
        cache_dir=tmp_path,
        system_metrics_interval=interval,
    )


def test_default_interval_is_short_enough_for_steps_of_seconds(monkeypatch):
    monkeypatch.delenv("DET_TASKS_SYSTEM_METRICS_INTERVAL", raising=False)
    assert RegistrySettings.from_env().system_metrics_interval == 1.0
    assert DEFAULT_SYSTEM_METRICS_INTERVAL_S == 1.0


def test_a_run_shorter_than_the_interval_gets_its_sample_and_a_later_one_continues(tmp_path):
    settings = _settings(tmp_path, 30.0)
    assert settings.tracking_uri is not None
    client = client_for(settings.tracking_uri)
    run = client.create_run(client.create_experiment("sampled"))
    run_id = run.info.run_id

    first = start_system_metrics(settings, run_id)
    assert first is not None and first.sampling_interval == 30.0
    time.sleep(0.2)
    first.finish()
    assert [m.step for m in client.get_metric_history(run_id, KEY)] == [0]

    second = start_system_metrics(settings, run_id)  # the trial continues elsewhere
    assert second is not None
    second.finish()
    assert sorted(m.step for m in client.get_metric_history(run_id, KEY)) == [0, 1]
    metrics = client.get_run(run_id).data.metrics
    assert {"system/system_memory_usage_megabytes", "system/disk_usage_percentage"} <= set(metrics)


def test_sampling_while_the_run_lasts(tmp_path):
    settings = _settings(tmp_path, 0.2)
    assert settings.tracking_uri is not None
    client = client_for(settings.tracking_uri)
    run_id = client.create_run(client.create_experiment("sampled")).info.run_id
    sampler = start_system_metrics(settings, run_id)
    assert sampler is not None
    time.sleep(1.2)
    sampler.finish()
    steps = sorted(m.step for m in client.get_metric_history(run_id, KEY))
    # About 6 samples while it ran plus the last; a loaded machine may delay a few.
    assert len(steps) >= 3 and steps == list(range(len(steps)))


def test_interval_zero_turns_it_off(tmp_path):
    assert start_system_metrics(_settings(tmp_path, 0.0), "any") is None
