"""What a user meets in MLflow's UI, in a real browser (Debian's chromium driven by
Playwright) against the real stack, for one grid experiment:

- the MLflow link an experiment prints lands on the "Model training" runs table (not
  MLflow 3.17's GenAI overview) with every trial listed flat, best first, and the searcher
  metric and hyperparameters as columns (the experiment's saved view);
- a click on the experiment in MLflow's own experiment list, and on a trial's name in the
  runs table, land in "Model training" once the user made the one click
  docs/concepts/tracking.md asks for (MLflow 3.17.2 reads the workspace from the browser,
  not from the experiment: without that click they land in GenAI pages);
- the saved view's Chart view opens on the searcher metric against the searched
  hyperparameters, and the runs page's "Views" menu lists the saved view."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"
VIEWPORT = {"width": 1600, "height": 1000}
METRIC = "validation/validation_loss"

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


def _url_when(page: Any, done: Callable[[str], bool], timeout_s: float = 15.0) -> str:
    """The page's URL once ``done`` holds for it (MLflow redirects after the first render)."""
    deadline = time.monotonic() + timeout_s
    while not done(page.url) and time.monotonic() < deadline:
        page.wait_for_timeout(250)  # not time.sleep: Playwright updates page.url meanwhile
    return str(page.url)


@dataclass(frozen=True)
class GridExperiment:
    name: str
    experiment_id: str
    link: str  # the one the experiment printed
    parent_name: str
    flow_run: str
    names: list[str]  # its trials, best first
    run_ids: dict[str, str]  # trial name -> MLflow run id


@pytest.fixture(scope="module")
def grid(stack) -> GridExperiment:
    """One 4-trial grid experiment through the real flow, for every test of this module."""
    from flows.experiment import experiment
    from registry.checkpoints.models import trial_runs
    from registry.runs.tracking import client_for

    name = "browser-grid"
    summary = experiment(str(FLOW_MODEL / "grid.yaml"), [f"name={name}"])
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name(name)
    (parent,) = client.search_runs([exp.experiment_id], "tags.`det.experiment_run` != ''")
    trials = sorted(
        trial_runs(client, parent),
        key=lambda t: (t.data.metrics["validation/validation_loss"], t.info.start_time),
    )
    return GridExperiment(
        name=name,
        experiment_id=str(exp.experiment_id),
        link=summary["mlflow_experiment"],
        parent_name=parent.info.run_name,
        flow_run=parent.data.tags["det.experiment_run"],
        names=[t.info.run_name for t in trials],
        run_ids={t.info.run_name: t.info.run_id for t in trials},
    )


@pytest.fixture
def browser() -> Iterator[Any]:
    """A fresh Chromium: no MLflow choice remembered (its local storage starts empty)."""
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def _shown(page: Any, text: str, shot: Path) -> str:
    page.screenshot(path=str(shot))
    return f"{page.url}\npage text (screenshot {shot}):\n{text[:3000]}"


def _best_first(text: str, names: list[str]) -> bool:
    positions = [text.index(n + "\n") for n in names]
    return positions == sorted(positions)


def test_printed_link_opens_the_trials_table_ready_to_compare(stack, grid, browser, tmp_path):
    assert grid.link.startswith(os.environ["MLFLOW_TRACKING_URI"])
    assert "workflowType=machine_learning" in grid.link and "viewStateShareKey=" in grid.link
    assert sorted(grid.names) == ["trial-1", "trial-2", "trial-3", "trial-4"]

    page = browser.new_page(viewport=VIEWPORT)
    page.goto(grid.link)
    wanted = [*grid.names, METRIC, "hp.learning_rate", "hp.hidden"]
    text = _text_when(page, [*wanted, "4 matching runs"])
    shown = _shown(page, text, tmp_path / "mlflow.png")
    # The runs table of the "Model training" workspace: its header and run count, the
    # trials (the parent row filtered out), the searcher metric and hyperparameter columns.
    assert "Run Name" in text and "4 matching runs" in text, shown
    for wanted_text in wanted:
        assert wanted_text in text, shown
    assert grid.parent_name not in text, shown
    # Best first: the trials appear in the order of their validation_loss.
    assert _best_first(text, grid.names), shown

    # Its Chart view: the searcher metric against the searched hyperparameters, in a
    # section before MLflow's own sections of the other metrics.
    page.locator("label:has(input[value=CHART])").first.click()  # "Chart view"
    charts = [
        "validation_loss against the hyperparameters",
        "Parallel Coordinates",
        f"hp.hidden vs. {METRIC}",
        f"hp.learning_rate vs. {METRIC}",
    ]
    text = _text_when(page, charts)
    shown = _shown(page, text, tmp_path / "charts.png")
    for chart in charts:
        assert chart in text, shown
    assert text.index(charts[0]) < text.index("System metrics"), shown

    # Prefect's flow-run page, served on the stack's own port (not Prefect's default 4200):
    # the UI reaches its server, and the Artifacts tab holds one trials table.
    ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    assert not ui.endswith(":4200"), ui
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(f"{ui}/runs/flow-run/{grid.flow_run}")
    _text_when(page, ["Artifacts", "train trial-1"])  # the graph's labels are canvas
    page.get_by_text("Artifacts", exact=True).first.click()
    text = _text_when(page, [f"{grid.name}-trials"])
    shown = _shown(page, text, tmp_path / "prefect.png")
    assert "Unable to connect" not in text, shown
    assert text.count(f"{grid.name}-trials") == 1, shown


def _mlflow_page(fragment: str) -> str:
    return f"{os.environ['MLFLOW_TRACKING_URI'].rstrip('/')}/{fragment}"


def _open_from_experiment_list(page: Any, grid: GridExperiment) -> None:
    """MLflow's experiment list, searched for the experiment, then its name clicked."""
    page.goto(_mlflow_page("#/experiments"))
    page.get_by_placeholder("Search experiments").fill(grid.name)
    page.get_by_role("link", name=grid.name, exact=True).first.click()


def test_clicks_in_mlflow_land_in_model_training_after_the_documented_click(
    stack, grid, browser, tmp_path
):
    genai = ["Overview", "Usage", "No data available"]
    experiment_page = f"#/experiments/{grid.experiment_id}"

    # What a fresh browser does without the click: the experiment opens in MLflow's GenAI
    # Overview, whatever the experiment's tags (if this fails, MLflow follows the tag now:
    # the click in docs/concepts/tracking.md may be unneeded).
    page = browser.new_page(viewport=VIEWPORT)
    _open_from_experiment_list(page, grid)
    url = _url_when(page, lambda u: f"{experiment_page}/" in u and "workflowType=" in u)
    text = _text_when(page, genai)
    shown = _shown(page, text, tmp_path / "genai.png")
    assert f"{experiment_page}/overview" in url and "workflowType=genai" in url, shown
    assert all(w in text for w in genai) and "Run Name" not in text, shown

    # The documented clicks, on MLflow's home page, once per browser: "Model training" at
    # the top of the sidebar, and the Assistant panel's close button.
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(_mlflow_page("#/experiments"))
    _text_when(page, ["Model training", grid.name])
    page.get_by_role("button", name="Model training", exact=True).click()
    page.get_by_role("button", name="Close", exact=True).first.click()
    page.reload()
    assert "Ask questions about your experiments" not in _text_when(page, [grid.name])

    # The experiment clicked in MLflow's experiment list: its runs table.
    _open_from_experiment_list(page, grid)
    text = _text_when(page, ["Run Name", "Views", grid.parent_name])
    url = page.url
    shown = _shown(page, text, tmp_path / "runs.png")
    assert url.split("?")[0].removesuffix("/runs").endswith(experiment_page), shown
    assert "genai" not in url and "Run Name" in text and "Views" in text, shown
    assert not any(w in text for w in genai), shown

    # Its "Views" menu lists the saved view, which opens the trials, best first.
    page.get_by_test_id("saved-views-trigger").click()
    page.get_by_text("Trials by validation_loss", exact=True).first.click()
    text = _text_when(page, [*grid.names, METRIC, "4 matching runs"])
    shown = _shown(page, text, tmp_path / "view.png")
    assert "viewStateShareKey=det-trials" in page.url, shown
    assert _best_first(text, grid.names), shown

    # A trial's name clicked in the runs table: its run page in "Model training" (the
    # breadcrumb says Runs, not GenAI's Evaluations), the searcher metric in its metrics.
    best = grid.names[0]
    page.get_by_role("link", name=best, exact=True).first.click()
    text = _text_when(page, ["Overview", "Model metrics", METRIC, "Parameters"])
    shown = _shown(page, text, tmp_path / "trial.png")
    assert page.url.split("?")[0].endswith(f"{experiment_page}/runs/{grid.run_ids[best]}"), shown
    assert "genai" not in page.url and "Evaluations" not in text, shown
    assert f"{grid.name}\nRuns\n{best}" in text, shown  # the breadcrumb, then the title
