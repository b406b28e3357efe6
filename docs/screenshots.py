"""Take the quickstart's screenshots of the Prefect and MLflow UIs in headless Chromium.

Not run in CI. Start a stack, run the const example through it, then run this with the
stack's environment; it writes small PNGs into docs/img/:

    export DET_TASKS_STACK_DIR=/tmp/docs-stack DET_TASKS_PREFECT_PORT=4500 ...
    python -m infra.stack up && python -m infra.stack deploy && source /tmp/docs-stack/env
    PREFECT_HOME=/tmp/docs-stack/prefect prefect deployment run experiment/const --watch
    python docs/screenshots.py
    python -m infra.stack down

The browser is Debian's ``chromium`` (``apt-get install -y chromium``) driven by Playwright.
``--only mlflow`` (or ``prefect``) retakes one UI's screenshots: the MLflow ones need only
``MLFLOW_TRACKING_URI`` and an ``mnist-const`` experiment.

Beside the PNGs it writes ``docs/img/screenshots.json``: what each screenshot shows that the
code decides (the saved runs view's filter, sort and columns with the inputs they came
from; the Prefect task names), read from the run it shows. tests/unit/test_screenshot_facts.py
fails when the code no longer produces them: retake the screenshots then.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

OUT = Path(__file__).resolve().parent / "img"
FACTS = OUT / "screenshots.json"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SETTLE_S = 6.0  # the single-page apps fetch and draw for a few seconds after "load"


def _flow_run_id(prefect_ui: str) -> str:
    """The newest completed flow run of the experiment flow, from Prefect's REST API."""
    import httpx

    api = os.environ["PREFECT_API_URL"]
    body = {
        "sort": "START_TIME_DESC",
        "limit": 5,
        "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
    }
    runs = httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()
    if not runs:
        sys.exit(f"no completed flow run on {prefect_ui}: run experiment/const first")
    return str(runs[0]["id"])


def _task_names(flow_run: str) -> list[str]:
    """The names of the flow run's task runs (what its graph labels), from Prefect's API."""
    import httpx

    api = os.environ["PREFECT_API_URL"]
    body = {"flow_runs": {"id": {"any_": [flow_run]}}, "sort": "EXPECTED_START_TIME_ASC"}
    runs = httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()
    return [str(r["name"]) for r in runs]


def _mlflow_ids(tracking_uri: str, name: str) -> tuple[str, str]:
    """(experiment id, a trial run id) of the named MLflow experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        sys.exit(f"no MLflow experiment {name!r} at {tracking_uri}")
    runs = client.search_runs([experiment.experiment_id], "tags.`mlflow.parentRunId` != ''")
    trial = runs[0] if runs else client.search_runs([experiment.experiment_id])[0]
    return experiment.experiment_id, trial.info.run_id


def _runs_view_facts(tracking_uri: str, experiment_id: str) -> dict[str, Any]:
    """What mlflow-runs.png shows that the code decides: the saved view's table (filter,
    sort, columns) and the inputs trials_view() made it from (searcher metric and
    direction from the parent run, the trials' hp.* params)."""
    from mlflow.tracking import MlflowClient

    from registry.runs.trials_view import TRIALS_VIEW_TAG, saved_view_state

    client = MlflowClient(tracking_uri)
    state = saved_view_state(client.get_experiment(experiment_id).tags[TRIALS_VIEW_TAG])
    (parent, *_) = client.search_runs([experiment_id], "tags.`det.experiment_run` != ''")
    trials = client.search_runs([experiment_id], "tags.`det.trial_id` != ''")
    table = ("searchFilter", "orderByKey", "orderByAsc", "selectedColumns", "runsHiddenMode")
    return {
        "metric": parent.data.tags["det.searcher.metric"],
        "smaller_is_better": parent.data.tags["det.searcher.smaller_is_better"] == "True",
        "hp_columns": sorted({k for t in trials for k in t.data.params if k.startswith("hp.")}),
        "view": {k: state[k] for k in table if k in state},
    }


def _record(facts: dict[str, Any]) -> None:
    """Merge ``facts`` (per screenshot file) into screenshots.json: a partial retake keeps
    the other screenshots' facts."""
    recorded = json.loads(FACTS.read_text()) if FACTS.exists() else {}
    recorded.update(facts)
    FACTS.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    print(f"{FACTS}")


def _best_effort(action: Any) -> None:
    """Click or type where the UI offers it; a UI that changed only loses the nicety."""
    try:
        action()
        time.sleep(SETTLE_S / 2)
    except Exception as err:  # playwright's TimeoutError and friends
        print(f"skipped a UI step: {str(err).splitlines()[0]}")


def _shot(page: Any, url: str, name: str, *steps: Any) -> None:
    page.goto(url, wait_until="load")
    time.sleep(SETTLE_S)
    for step in steps:
        _best_effort(lambda step=step: step(page))
    path = OUT / name
    page.screenshot(path=str(path))
    print(f"{path} ({path.stat().st_size // 1024} KB)")


def _close_mlflow_assistant(page: Any) -> None:
    """MLflow 3.17 opens an "Assistant" side panel that would cover half the page."""
    page.get_by_role("button", name="Close", exact=True).first.click(timeout=5000)


def _prefect_shots(page: Any) -> dict[str, Any]:
    prefect_ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    flow_run = _flow_run_id(prefect_ui)
    run_url = f"{prefect_ui}/runs/flow-run/{flow_run}"
    _shot(page, run_url, "prefect-flow-run.png")
    _shot(
        page,
        run_url,
        "prefect-trials-artifact.png",
        lambda p: p.locator("li.p-tab", has_text="Artifacts").first.click(timeout=5000),
        lambda p: p.get_by_text("-trials", exact=False).first.click(timeout=5000),
    )
    return {"prefect-flow-run.png": {"task_names": _task_names(flow_run)}}


def _mlflow_shots(page: Any) -> dict[str, Any]:
    from registry.runs.tracking import mlflow_link

    mlflow_ui = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    experiment_id, trial_run = _mlflow_ids(mlflow_ui, "mnist-const")
    # The link the experiment prints: its saved runs view, as a user first sees it.
    _shot(page, mlflow_link(mlflow_ui, experiment_id), "mlflow-runs.png", _close_mlflow_assistant)
    _shot(
        page,
        mlflow_link(mlflow_ui, experiment_id, trial_run).replace("?", "/model-metrics?"),
        "mlflow-trial-metrics.png",
        _close_mlflow_assistant,
        lambda p: p.get_by_placeholder("Search metric charts").fill("validation"),
    )
    return {"mlflow-runs.png": _runs_view_facts(mlflow_ui, experiment_id)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Retake the docs' screenshots of the UIs.")
    parser.add_argument("--only", choices=("mlflow", "prefect"), help="retake one UI's shots")
    only = parser.parse_args(argv).only
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium not found: apt-get install -y chromium")
    OUT.mkdir(exist_ok=True)
    facts: dict[str, Any] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        if only != "mlflow":
            facts.update(_prefect_shots(page))
        if only != "prefect":
            facts.update(_mlflow_shots(page))
        browser.close()
    _record(facts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
