"""``det experiment list`` asks MLflow a fixed number of questions per page, not a few per
experiment and one per trial (issue 53): the experiments, the parent runs, the trial runs
(registry.experiments.view.summarize_experiment_runs), against a reader that pages as
MLflow's REST API does."""

from __future__ import annotations

import types
from typing import Any

from registry.experiments.view import summarize_experiment_runs


def _run(run_id: str, experiment: str, **tags: str) -> Any:
    return types.SimpleNamespace(
        info=types.SimpleNamespace(run_id=run_id, experiment_id=experiment),
        data=types.SimpleNamespace(tags=tags),
    )


class PagingReader:
    """MLflow's search calls over fixed runs, ``page`` runs a page, counting requests."""

    def __init__(self, runs: list[Any], page: int) -> None:
        self.runs, self.page, self.requests = runs, page, 0

    def search_experiments(self) -> list[Any]:
        self.requests += 1
        return [types.SimpleNamespace(experiment_id=e, name=f"exp-{e}") for e in ("1", "2")]

    def search_runs(self, ids: list[str], filter_string: str, order_by: Any = None,
                    page_token: str | None = None) -> list[Any]:  # fmt: skip
        self.requests += 1
        tag = filter_string.split("`")[1]
        found = [r for r in self.runs if r.info.experiment_id in ids and r.data.tags.get(tag)]
        start = int(page_token or 0)
        rows = found[start : start + self.page]
        more = start + self.page < len(found)
        return type("Page", (list,), {"token": str(start + self.page) if more else None})(rows)


def _experiments(count: int, trials: int) -> list[Any]:
    runs = []
    for n in range(count):
        tags = {"det.experiment_run": f"key-{n}", "det.searcher.metric": "loss",
                "det.best.loss": f"0.{n + 1}"}  # fmt: skip
        runs.append(_run(f"p{n}", str(1 + n % 2), **tags))
        runs += [_run(f"t{n}-{t}", str(1 + n % 2), **{"mlflow.parentRunId": f"p{n}"})
                 for t in range(trials)]  # fmt: skip
    return runs


def test_a_page_costs_three_requests_however_many_experiments_and_trials() -> None:
    for count in (2, 20):
        reader = PagingReader(_experiments(count, trials=6), page=1000)
        keys = [f"key-{n}" for n in range(count)]
        summaries = summarize_experiment_runs(reader, keys)
        assert reader.requests == 3
        assert [summaries[k].trials for k in keys] == [6] * count
        assert summaries["key-1"].name == "exp-2" and summaries["key-1"].best == 0.2


def test_mlflows_pages_are_followed_and_a_key_without_a_parent_is_left_out() -> None:
    reader = PagingReader(_experiments(3, trials=4), page=2)
    summaries = summarize_experiment_runs(reader, ["key-0", "key-2", "not-started"])
    assert {k: s.trials for k, s in summaries.items()} == {"key-0": 4, "key-2": 4}
