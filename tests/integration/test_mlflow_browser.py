"""The MLflow link an experiment prints, opened in a real browser (Debian's chromium driven
by Playwright) against the real stack: it lands on the "Model training" runs table (not
MLflow 3.17's GenAI overview) with every trial listed flat, best first, and the searcher
metric and hyperparameters as columns (the experiment's saved view)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"

pytestmark = pytest.mark.slow


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium on PATH: apt-get install -y chromium (.ci/run does)")
    pytest.importorskip("playwright", reason="the docs extra (playwright) is not installed")
    return path


def _text_when(page: Any, wanted: list[str], timeout_s: float = 30.0) -> str:
    """The page's text once it shows every string in ``wanted`` (the SPA renders late)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = page.inner_text("body")
        if all(w in text for w in wanted):
            return text
        time.sleep(0.5)
    return text


def test_printed_link_opens_the_trials_table_ready_to_compare(stack, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    from flows.experiment import experiment
    from registry.models import trial_runs
    from registry.tracking import client_for

    name = "browser-grid"
    summary = experiment(str(FLOW_MODEL / "grid.yaml"), [f"name={name}"])
    link = summary["mlflow_experiment"]
    assert link.startswith(os.environ["MLFLOW_TRACKING_URI"])
    assert "workflowType=machine_learning" in link and "viewStateShareKey=" in link

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name(name)
    (parent,) = client.search_runs([exp.experiment_id], "tags.`det.experiment_run` != ''")
    trials = trial_runs(client, parent)
    best_first = sorted(
        trials, key=lambda t: (t.data.metrics["validation/validation_loss"], t.info.start_time)
    )
    names = [t.info.run_name for t in best_first]
    assert sorted(names) == ["trial-1", "trial-2", "trial-3", "trial-4"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(link)
            wanted = [*names, "validation/validation_loss", "hp.learning_rate", "hp.hidden"]
            text = _text_when(page, [*wanted, "4 matching runs"])
            page.screenshot(path=str(tmp_path / "mlflow.png"))
        finally:
            browser.close()
    shown = f"page text (screenshot {tmp_path / 'mlflow.png'}):\n{text[:3000]}"
    # The runs table of the "Model training" workspace: its header and run count, the
    # trials (the parent row filtered out), the searcher metric and hyperparameter columns.
    assert "Run Name" in text and "4 matching runs" in text, shown
    for wanted_text in wanted:
        assert wanted_text in text, shown
    assert parent.info.run_name not in text, shown
    # Best first: the trials appear in the order of their validation_loss.
    positions = [text.index(n + "\n") for n in names]
    assert positions == sorted(positions), shown

    # Prefect's flow-run page, served on the stack's own port (not Prefect's default 4200):
    # the UI reaches its server, and the Artifacts tab holds one trials table.
    ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    assert not ui.endswith(":4200"), ui
    flow_run = parent.data.tags["det.experiment_run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{ui}/runs/flow-run/{flow_run}")
            _text_when(page, ["Artifacts", "train trial-1"])  # the graph's labels are canvas
            page.get_by_text("Artifacts", exact=True).first.click()
            text = _text_when(page, [f"{name}-trials"])
            page.screenshot(path=str(tmp_path / "prefect.png"))
        finally:
            browser.close()
    shown = f"page text (screenshot {tmp_path / 'prefect.png'}):\n{text[:3000]}"
    assert "Unable to connect" not in text, shown
    assert text.count(f"{name}-trials") == 1, shown
