"""A deployment's flow checks the entrypoint from its source (issue 53 item 4: no import of
the user's module, nor torch, in the flow process). On the stack, through
``det experiment create``: a class the module does not define is refused by the flow before
any MLflow run exists; a module that fails on import passes that check, and its trial's
worker reports the failure once, as final (no retry, though ``max_restarts`` is 2), naming
the entrypoint and the user's line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from infra.stack import deploy
from registry.runs.tracking import client_for
from tests.integration.helpers import FLOW_MODEL


def _prefect(path: str, body: dict[str, Any] | None = None) -> Any:
    import json
    import urllib.request

    request = urllib.request.Request(
        os.environ["PREFECT_API_URL"] + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _create(model: Path, name: str) -> str:
    """``det experiment create`` of the XOR trial in ``model``: the flow run's id."""
    det = str(Path(sys.executable).with_name("det"))
    created = subprocess.run(
        [det, "experiment", "create", "killable.yaml", ".", "--config", f"name={name}"],
        cwd=model, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr[-3000:]
    short = next(x for x in created.stdout.splitlines() if x.startswith("Created ")).split()[-1]
    runs = _prefect("/flow_runs/filter", {"limit": 50, "sort": "EXPECTED_START_TIME_DESC"})
    return next(r["id"] for r in runs if r["id"].startswith(short))


def _ended(flow_run_id: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _prefect(f"/flow_runs/{flow_run_id}")["state_type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return str(state)
        time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id} did not end within {timeout} s")


def _model(tmp_path: Path, folder: str, edit: str) -> Path:
    model = tmp_path / folder
    shutil.copytree(FLOW_MODEL, model)
    source = model / "model_def.py"
    source.write_text(source.read_text() + edit)
    return model


def test_the_flow_refuses_a_missing_class_and_the_worker_a_failing_import_once(
    stack, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    deploy(stack)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    tag = uuid.uuid4().hex[:6]
    # The class renamed away: the source shows it, so the flow refuses it.
    renamed = _model(tmp_path, "renamed", "")
    (renamed / "model_def.py").write_text(
        (renamed / "model_def.py").read_text().replace("class XorTrial(", "class XorTrail(")
    )
    # A module that raises on import: only the import can tell.
    failing = _model(tmp_path, "failing", "\nimport no_such_module_here  # noqa\n")
    line = len((failing / "model_def.py").read_text().splitlines())
    missing_run = _create(renamed, f"entry-missing-{tag}")
    failing_run = _create(failing, f"entry-failing-{tag}")

    assert _ended(missing_run) == "FAILED"
    said = _prefect(f"/flow_runs/{missing_run}")["state"]["message"]
    assert "model_def.py has no 'XorTrial'; classes defined there: XorData, XorTrail" in said
    experiment = client.get_experiment_by_name(f"entry-missing-{tag}")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []

    assert _ended(failing_run) == "FAILED"
    tasks = _prefect("/task_runs/filter", {"flow_runs": {"id": {"any_": [failing_run]}}})
    trains = [t for t in tasks if t["name"].startswith("train ")]
    assert [t["run_count"] for t in trains] == [1], trains  # final: not retried
    experiment = client.get_experiment_by_name(f"entry-failing-{tag}")
    assert experiment is not None
    (trial,) = client.search_runs([experiment.experiment_id], "tags.`det.trial_id` = '1'")
    error = trial.data.tags["det.error"]
    assert (
        "entrypoint 'model_def:XorTrial' fails to import: ModuleNotFoundError: No module "
        "named 'no_such_module_here' ("
    ) in error, error
    assert f"model_def.py:{line})" in error, error
    assert trial.info.status == "FAILED"
