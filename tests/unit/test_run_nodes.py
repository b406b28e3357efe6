"""registry.runs.run_nodes: the hosts a trial ran on, kept on its run and shown by ``det
experiment describe``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from registry.runs.run_nodes import MAX_NODES, NODES_TAG, nodes_of, record_node


class _Client:
    """Just the two calls record_node makes, on one run's tags."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.writes = 0

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(data=SimpleNamespace(tags=dict(self.tags)))

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags[key] = value
        self.writes += 1


def test_each_host_is_added_once_in_a_row_and_a_return_counts_again() -> None:
    client = _Client()
    assert nodes_of(client.tags) == []
    for host in ["n1", "n1", "n2", "n1"]:
        record_node(client, "run", host)
    assert client.tags[NODES_TAG] == "n1,n2,n1"
    assert client.writes == 3  # the second "n1" in a row wrote nothing
    assert nodes_of(client.tags) == ["n1", "n2", "n1"]


def test_only_the_newest_hosts_are_kept() -> None:
    client = _Client()
    for i in range(MAX_NODES + 5):
        record_node(client, "run", f"node{i}")
    kept = nodes_of(client.tags)
    assert len(kept) == MAX_NODES and kept[0] == "node5" and kept[-1] == f"node{MAX_NODES + 4}"


def test_describe_names_the_nodes_each_trial_ran_on(capsys: pytest.CaptureFixture[str]) -> None:
    from det_cli.submission import print_trials
    from registry.experiments.view import TrialProgress, TrialView

    progress = TrialProgress(
        batches=120, best=0.5, best_step=120, latest=0.5, latest_step=120, checkpoint="c"
    )
    view = SimpleNamespace(
        metric="validation_loss",
        trials=[
            TrialView("1", "r1", "COMPLETED", progress, nodes=("n1", "n2")),
            TrialView("2", "r2", "QUEUED", progress),
        ],
    )
    print_trials(view)
    header, _, first, second = capsys.readouterr().out.splitlines()
    assert header.endswith("best checkpoint  nodes")
    assert first.split()[-1] == "n1,n2" and second.split()[-1] == "c"
