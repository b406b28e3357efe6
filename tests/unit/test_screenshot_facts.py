"""The docs' screenshots still show what the code produces. docs/screenshots.py records, next
to the PNGs (docs/img/screenshots.json), what each shows that the code decides, read from the
run it photographed; these tests recompute those facts from today's code. A failure means a
screenshot is out of date: retake it (docs/screenshots.py, `--only mlflow` or `--only prefect`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from registry.runs.trials_view import trials_view

FACTS = Path(__file__).resolve().parents[2] / "docs" / "img" / "screenshots.json"
RETAKE = "retake the screenshots: python docs/screenshots.py (see its docstring)"


def _facts(png: str) -> dict[str, Any]:
    recorded = json.loads(FACTS.read_text())
    assert (FACTS.parent / png).is_file(), f"{png} is recorded but missing from docs/img"
    facts = recorded[png]
    assert isinstance(facts, dict)
    return facts


def test_every_recorded_screenshot_is_in_the_docs():
    recorded = json.loads(FACTS.read_text())
    assert {"mlflow-runs.png", "prefect-flow-run.png"} <= set(recorded)
    docs = "".join(p.read_text() for p in FACTS.parents[1].rglob("*.md"))
    for png in recorded:
        assert f"img/{png}" in docs, f"docs/img/{png} is recorded but no page shows it"


def test_the_runs_screenshot_shows_the_view_the_code_writes():
    """Filter (trials only, flat), sort (searcher metric, its direction) and columns."""
    facts = _facts("mlflow-runs.png")
    today = json.loads(
        trials_view(facts["metric"], facts["smaller_is_better"], facts["hp_columns"])
    )
    assert facts["view"] == today, f"mlflow-runs.png shows another saved view: {RETAKE}"


def test_the_flow_run_screenshot_names_its_tasks_as_the_code_does():
    from det_tasks.runner.held import TrialSpec
    from flows.tasks import TrialRef

    names = _facts("prefect-flow-run.png")["task_names"]
    assert {name.split(" ", 1)[0] for name in names} == {"train", "validate", "checkpoint"}
    for name in names:
        kind, trial, where = name.split(" ", 2)
        assert trial.startswith("trial-"), f"{name!r}: {RETAKE}"
        spec = TrialSpec(
            config_path="c.yaml",
            model_dir=".",
            overrides=(),
            trial_id=int(trial.removeprefix("trial-")),
            hparams={},
        )
        ref = TrialRef(spec=spec, parent_run_id="p" * 32, experiment_id="1", mlflow_run_id="a")
        assert ref.task_name(kind, where) == name, f"prefect-flow-run.png: {RETAKE}"


@pytest.mark.parametrize("png", ["mlflow-runs.png", "prefect-flow-run.png"])
def test_a_changed_view_or_task_name_would_fail(png, monkeypatch):
    """The checks above compare with the code, not with themselves: a different view or
    task-name form makes them fail."""
    import registry.runs.trials_view as views
    from flows.tasks import TrialRef

    if png == "mlflow-runs.png":
        monkeypatch.setattr(views, "TRIALS_FILTER", "attributes.status != ''")
        with pytest.raises(AssertionError, match="another saved view"):
            test_the_runs_screenshot_shows_the_view_the_code_writes()
    else:
        monkeypatch.setattr(TrialRef, "task_name", lambda self, kind, where: f"{kind} {where}")
        with pytest.raises(AssertionError, match=r"prefect-flow-run\.png"):
            test_the_flow_run_screenshot_names_its_tasks_as_the_code_does()
