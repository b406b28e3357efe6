"""A warm worker ends a finished trial on a thread of its own (flows.workers): the step
returns first, and whatever touches the worker next waits for that end."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest

from det_tasks.runner.held import TrialSpec
from flows.workers import HeldTrialPlugin


class _Trial:
    """Stands in for a HeldTrial: its close blocks until let go, and records its error."""

    def __init__(self, fail: bool = False) -> None:
        self.spec = TrialSpec("c.yaml", ".", (), trial_id=7, hparams={}, experiment_run_key="k")
        self.let_go = threading.Event()
        self.closed_with: list[BaseException | None] = []
        self.fail = fail

    def close(self, error: BaseException | None = None) -> None:
        assert self.let_go.wait(10)
        self.closed_with.append(error)
        if self.fail:
            raise OSError("MLflow went away")


def _plugin_holding(trial: _Trial) -> HeldTrialPlugin:
    plugin = HeldTrialPlugin(max_trials=16)
    plugin.held = trial  # type: ignore[assignment]
    return plugin


def test_the_end_runs_after_the_step_and_settle_waits_for_it() -> None:
    trial = _Trial()
    plugin = _plugin_holding(trial)
    stopped = RuntimeError("stopped")
    plugin.release_in_background(stopped)
    assert plugin.held is None and trial.closed_with == []  # returned before the end
    trial.let_go.set()
    plugin.settle()
    assert trial.closed_with == [stopped] and plugin.ending is None


def test_the_ended_trial_is_freed_not_kept_by_its_thread() -> None:
    trial = _Trial()
    gone = weakref.ref(trial)
    plugin = _plugin_holding(trial)
    trial.let_go.set()
    del trial
    plugin.release_in_background()
    plugin.settle()
    gc.collect()
    assert gone() is None


def test_release_and_a_new_release_wait_for_the_end_still_going() -> None:
    first, second = _Trial(), _Trial()
    plugin = _plugin_holding(first)
    plugin.release_in_background()
    plugin.held = second  # type: ignore[assignment]
    first.let_go.set()
    second.let_go.set()
    plugin.release()  # what teardown and release_all do
    assert first.closed_with == [None] and second.closed_with == [None]
    assert plugin.ending is None and plugin.held is None


def test_a_failed_end_is_logged_on_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    trial = _Trial(fail=True)
    plugin = _plugin_holding(trial)
    trial.let_go.set()
    with caplog.at_level(logging.ERROR, logger="flows.workers"):
        plugin.release_in_background()
        plugin.settle()
    assert "ending trial k/trial-7 failed" in caplog.text and "MLflow went away" in caplog.text


def test_the_plugin_travels_without_its_thread() -> None:
    import pickle

    trial = _Trial()
    plugin = _plugin_holding(trial)
    plugin.release_in_background()
    plugin.held = None
    copy = pickle.loads(pickle.dumps(plugin))
    trial.let_go.set()
    plugin.settle()
    assert copy.ending is None
