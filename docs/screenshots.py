"""Take the quickstart's screenshots of the Prefect and MLflow UIs in headless Chromium.

Not run in CI. Start a stack, run the const example through it, then run this with the
stack's environment; it writes small PNGs into docs/img/:

    export DET_TASKS_STACK_DIR=/tmp/docs-stack DET_TASKS_PREFECT_PORT=4500 ...
    python -m infra.stack up && python -m infra.stack deploy && source /tmp/docs-stack/env
    PREFECT_HOME=/tmp/docs-stack/prefect prefect deployment run experiment/const --watch
    python docs/screenshots.py
    python -m infra.stack down

The browser is Debian's ``chromium`` (``apt-get install -y chromium``) driven by Playwright.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

OUT = Path(__file__).resolve().parent / "img"
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


def main() -> int:
    from playwright.sync_api import sync_playwright

    prefect_ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    mlflow_ui = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    flow_run = _flow_run_id(prefect_ui)
    experiment_id, trial_run = _mlflow_ids(mlflow_ui, "mnist-const")
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium not found: apt-get install -y chromium")
    OUT.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        run_url = f"{prefect_ui}/runs/flow-run/{flow_run}"
        _shot(page, run_url, "prefect-flow-run.png")
        _shot(
            page,
            run_url,
            "prefect-trials-artifact.png",
            lambda p: p.locator("li.p-tab", has_text="Artifacts").first.click(timeout=5000),
            lambda p: p.get_by_text("-trials", exact=False).first.click(timeout=5000),
        )
        ml = "workflowType=machine_learning"
        close_assistant = _close_mlflow_assistant
        _shot(
            page,
            f"{mlflow_ui}/#/experiments/{experiment_id}/runs?{ml}",
            "mlflow-runs.png",
            close_assistant,
            lambda p: p.locator(
                '[role=gridcell] button[data-component-id*="runnamecell"]'
            ).first.click(timeout=5000),
        )
        _shot(
            page,
            f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{trial_run}/model-metrics?{ml}",
            "mlflow-trial-metrics.png",
            close_assistant,
            lambda p: p.get_by_placeholder("Search metric charts").fill("validation"),
        )
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
