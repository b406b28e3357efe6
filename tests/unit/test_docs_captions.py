"""The docs' screenshot captions say what the screenshots show. docs/screenshots.py records
beside the PNGs (docs/img/screenshots.json) what each one shows that the code decides, read
from the run it photographed: the Prefect task names, the MLflow view's sort and columns.
A caption (the image's alt text and the parenthesised paragraph after it) that quotes a
task, counts the trials or describes the view must agree with those records, so a retaken
screenshot with a stale caption, or a caption edited away from its image, fails here."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FACTS = DOCS / "img" / "screenshots.json"
TASK = re.compile(r"`((?:train|validate|checkpoint) trial-[^`]*)`")
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "eight": 8}


def captions(png: str, pages: list[tuple[str, str]]) -> list[str]:
    """Each caption of ``png`` in ``pages`` ((name, markdown) pairs): the image's alt text,
    plus the paragraph right after it when that paragraph is in parentheses."""
    found = []
    image = re.compile(
        r"!\[([^\]]*)\]\((?:\.\./)*img/"
        + re.escape(png)
        + r"\)\n\n?(\([^)]*(?:\([^)]*\)[^)]*)*\))?"
    )
    for _, text in pages:
        for match in image.finditer(text):
            found.append(" ".join(f"{match.group(1)} {match.group(2) or ''}".split()))
    return found


def _trials_said(caption: str) -> int | None:
    words = "|".join(NUMBERS)
    said = re.search(rf"\b(\d+|{words})[- ]trials?\b", caption, re.IGNORECASE)
    if said is None:
        return None
    count = said.group(1).lower()
    return int(count) if count.isdigit() else NUMBERS[count]


def check_flow_run(caption: str, facts: dict[str, Any]) -> None:
    names = facts["task_names"]
    quoted = TASK.findall(caption)
    assert quoted, f"the caption quotes none of the tasks the screenshot shows {names}"
    for name in quoted:
        assert name in names, f"the caption quotes {name!r}; the screenshot shows {names}"
    trials = {name.split()[1] for name in names}
    said = _trials_said(caption)
    assert said in (None, len(trials)), (
        f"the caption says {said} trial(s); the screenshot shows {len(trials)}"
    )


def check_runs_view(caption: str, facts: dict[str, Any]) -> None:
    view = facts["view"]
    if "best first" in caption:
        assert view["orderByAsc"] == facts["smaller_is_better"], "the view is not best first"
        assert facts["metric"] in view["orderByKey"], "the view is not sorted by the metric"
    if "hyperparameters as columns" in caption:
        for column in facts["hp_columns"]:
            assert f"params.`{column}`" in view["selectedColumns"], f"{column} is no column"
    if "searcher metric" in caption:
        assert f"metrics.`validation/{facts['metric']}`" in view["selectedColumns"]


CHECKS: dict[str, Callable[[str, dict[str, Any]], None]] = {
    "prefect-flow-run.png": check_flow_run,
    "mlflow-runs.png": check_runs_view,
}


def _pages() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(DOCS.rglob("*.md"))]


RECORDED: dict[str, dict[str, Any]] = json.loads(FACTS.read_text())


@pytest.mark.parametrize("png", sorted(RECORDED))
def test_every_caption_of_a_recorded_screenshot_matches_its_facts(png):
    assert png in CHECKS, f"{png} is recorded in screenshots.json: add its caption check here"
    found = captions(png, _pages())
    assert found, f"no page shows img/{png} with a caption"
    for caption in found:
        CHECKS[png](caption, RECORDED[png])


def test_the_quickstart_caption_is_read_whole():
    """The parser takes the alt text and the parenthesised paragraph (with its own
    parentheses inside), not just the first line."""
    (caption,) = captions(
        "prefect-flow-run.png", [("quickstart", (DOCS / "quickstart.md").read_text())]
    )
    assert TASK.findall(caption) == [
        "train trial-1 0-8 epochs",
        "validate trial-1 @176",
        "checkpoint trial-1 @176",
    ]
    assert _trials_said(caption) == 1


@pytest.mark.parametrize(
    "stale",
    [
        # The caption the quickstart had while the image showed the one-trial const run.
        "(A 4-trial grid experiment, two at a time. Each trial is a chain `train trial-N 0-40`"
        " -> `validate trial-N @40` -> `checkpoint trial-N @40`.)",
        "(A 4-trial grid experiment: `train trial-1 0-8 epochs`.)",
        "(Nothing about the tasks.)",
    ],
)
def test_a_caption_that_disagrees_with_its_screenshot_fails(stale):
    page = f"![Prefect UI](img/prefect-flow-run.png)\n\n{stale}\n"
    (caption,) = captions("prefect-flow-run.png", [("page", page)])
    with pytest.raises(AssertionError):
        check_flow_run(caption, RECORDED["prefect-flow-run.png"])


def test_a_view_caption_that_disagrees_fails():
    facts = json.loads(json.dumps(RECORDED["mlflow-runs.png"]))
    facts["view"]["orderByAsc"] = not facts["smaller_is_better"]
    with pytest.raises(AssertionError, match="best first"):
        check_runs_view("its trials best first", facts)
