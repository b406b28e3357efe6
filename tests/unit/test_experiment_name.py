"""An experiment's name is decided once, where its config enters, and travels with the
config as an override: a config without ``name:`` submitted as ``noname.yaml`` is
``noname`` for the flow and for every worker, even where the worker writes the config to a
file of its own (it was ``config-<hash>``: a second MLflow experiment, runs left RUNNING).
``det experiment list`` shows that name before the flow has started."""

from __future__ import annotations

import argparse
import datetime
import uuid
from pathlib import Path
from typing import Any

import pytest

from det_cli import submission
from det_tasks.config.experiment_name import name_override, named, submitted_name
from det_tasks.runner.trial_setup import load_raw_config
from flows.prefect_rest import FlowRun

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "submit_model" / "const.yaml"


def nameless_config(folder: Path, file_name: str = "noname.yaml") -> Path:
    text = FIXTURE.read_text(encoding="utf-8")
    assert text.startswith("name: submit-xor\n")
    config = folder / file_name
    config.write_text(text.removeprefix("name: submit-xor\n"), encoding="utf-8")
    return config


def test_a_nameless_config_is_named_once_and_a_worker_copy_keeps_the_name(tmp_path):
    config = nameless_config(tmp_path)
    raw, cfg = load_raw_config(config, ["searcher.max_length={batches: 4}"])
    assert cfg.name is None and "name" not in raw
    raw, cfg, overrides = named(raw, cfg, config, ["searcher.max_length={batches: 4}"])
    assert cfg.name == "noname" and raw["name"] == "noname"
    assert overrides == ["searcher.max_length={batches: 4}", 'name="noname"']
    # What a worker does with a submitted experiment: the config's text written to a file
    # named after its hash, read with the overrides the flow sent.
    worker_copy = tmp_path / "config-ddd979602d7b.yaml"
    worker_copy.write_text(config.read_text(encoding="utf-8"), encoding="utf-8")
    worker_raw, worker_cfg = load_raw_config(worker_copy, overrides)
    assert worker_cfg.name == "noname" and worker_raw == raw


def test_a_named_config_keeps_its_name_and_overrides():
    raw, cfg = load_raw_config(FIXTURE, [])
    assert named(raw, cfg, FIXTURE, []) == (raw, cfg, [])


@pytest.mark.parametrize("stem", ["2024", "true", "null", "a: b", "réseau #1"])
def test_the_name_override_keeps_any_stem_as_text(tmp_path, stem):
    config = nameless_config(tmp_path, f"{stem}.yaml")
    raw, cfg = load_raw_config(config, [])
    _, cfg, overrides = named(raw, cfg, config, [])
    assert cfg.name == stem and overrides == [name_override(stem)]
    assert load_raw_config(config, overrides)[1].name == stem


def test_submitted_name_is_the_configs_name_not_its_file():
    text = FIXTURE.read_text(encoding="utf-8")
    assert submitted_name("long.yaml", text, []) == "submit-xor"
    assert submitted_name("long.yaml", text, ["name=other"]) == "other"
    assert submitted_name("long.yaml", "entrypoint: a:B\n", ['name="noname"']) == "noname"
    assert submitted_name("dir/long.yaml", None, []) == "long"
    assert submitted_name("long.yaml", "name: [unclosed", []) == "long"


def test_create_sends_the_decided_name_to_the_flow(tmp_path, monkeypatch, capsys):
    config = nameless_config(tmp_path, "const.yaml")
    sent: dict[str, Any] = {}

    def start(deployment: str, parameters: dict[str, Any], tags: list[str]) -> Any:
        sent.update(parameters)
        return argparse.Namespace(id=uuid.UUID(int=1))

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DET_TASKS_DASK_SCHEDULER", raising=False)
    monkeypatch.setattr(submission, "_ship", lambda *args: "s3://det-tasks/packages/x.tar.gz")
    monkeypatch.setattr(submission, "start_deployment_run", start)
    args = argparse.Namespace(
        config=config,
        model_dir=tmp_path,
        param=["searcher.max_length={batches: 4}"],
        max_package_mb=96.0,
        deployment=submission.EXPERIMENT_DEPLOYMENT,
        follow=False,
    )
    assert submission.cmd_experiment_create(args) == 0
    assert sent["overrides"] == ["searcher.max_length={batches: 4}", 'name="const"']
    assert sent["config_yaml"] == config.read_text(encoding="utf-8")  # the user's text


def test_list_shows_the_configs_name_before_the_flow_starts(monkeypatch, capsys):
    """The issue's `det experiment list`: `long.yaml` until the flow started."""
    import registry.cli
    import registry.experiments.view

    text = FIXTURE.read_text(encoding="utf-8").replace("submit-xor", "long-run")
    pending = FlowRun(
        id=uuid.UUID(int=2),
        name="quiet-fox",
        state="PENDING",
        state_name="Pending",
        state_message="",
        parameters={"config": "long.yaml", "config_yaml": text, "overrides": []},
        start_time=datetime.datetime(2026, 11, 28, tzinfo=datetime.UTC),
    )
    monkeypatch.setattr(submission, "experiment_runs", lambda limit: [pending])
    monkeypatch.setattr(registry.cli, "tracking_reader_from_env", lambda: None)
    monkeypatch.setattr(registry.cli, "end_orphans_seen", lambda client: [])
    monkeypatch.setattr(registry.experiments.view, "summarize_experiment_runs", lambda c, k: {})
    assert submission.cmd_experiment_list(argparse.Namespace(limit=20)) == 0
    (row,) = capsys.readouterr().out.strip().splitlines()[2:]
    assert row.split()[1] == "long-run", row
