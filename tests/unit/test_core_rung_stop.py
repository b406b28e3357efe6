"""A Core API script in Determined 0.38's form (no ``searcher.operations()``) under ASHA:
``should_preempt()`` turns True once it reported the batch of the length the searcher gave
it (a rung, or ASHA's ``max_time``), without acknowledging a pause; other searchers let the
script decide how long it trains."""

from __future__ import annotations

from typing import Any

import pytest

from det_tasks.core._distributed import DummyDistributedContext
from det_tasks.core._preempt import PreemptContext
from det_tasks.core._searcher import SearcherContext, rung_stop
from det_tasks.run_services import TrialControl

ASHA = {"name": "adaptive_asha", "metric": "x", "time_metric": "batches", "max_time": 40}


def _preempt(searcher_length: Any, section: dict[str, Any]) -> tuple[Any, Any, Any]:
    control = TrialControl()
    searcher = SearcherContext(DummyDistributedContext(), 0, None, None)
    stop = rung_stop(searcher, searcher_length, {"searcher": section}, control)
    preempt = PreemptContext(control, DummyDistributedContext(), searcher_stop=stop).start()
    return control, searcher, preempt


@pytest.mark.parametrize("length", [10, 40])  # a rung, and the top (max_time)
def test_asha_stops_the_script_once_it_reported_its_rung_without_a_pause(length):
    control, _, preempt = _preempt({"batches": length}, ASHA)
    control.reached(length - 1)
    assert preempt.should_preempt() is False
    control.reached(length + 5)  # the script's own boundary may come after the rung
    assert preempt.should_preempt() is True
    assert control.acknowledged is False  # the segment ended; nothing to continue as paused


def test_a_script_that_uses_operations_is_ended_by_its_operation_instead():
    control, searcher, preempt = _preempt({"batches": 10}, ASHA)
    searcher.operations_used = True
    control.reached(10)
    assert preempt.should_preempt() is False


@pytest.mark.parametrize(
    ("section", "length", "stops"),
    [
        ({"name": "single", "max_length": {"batches": 50}}, 50, False),  # its own length
        ({"name": "grid"}, None, False),  # no length at all
        ({"name": "optuna", "max_length": {"batches": 40}}, 20, True),  # a pruner's rung
        ({"name": "random", "max_length": {"epochs": 2}}, 30, False),  # no batch count
    ],
)
def test_other_searchers_stop_a_script_only_short_of_its_whole_length(section, length, stops):
    control, _, preempt = _preempt({"batches": length} if length else None, section)
    control.reached(100)
    assert preempt.should_preempt() is stops


def test_a_platform_stop_request_is_still_acknowledged_as_a_pause():
    control, _, preempt = _preempt({"batches": 10}, ASHA)
    control.request_stop()
    assert preempt.should_preempt() is True and control.acknowledged is True
