"""What keeps experiments that share workers out of each other's way, and what a stop or a
dead worker tells the user: the held-trial plugin installs once, a step does not evict
another experiment's active trial, workers ignore the group's signals, the stop grace is
read and checked, and a worker's exit code becomes a likely cause."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from distributed import Reschedule

from cluster.held_trials import FOREIGN_ACTIVE_S, HeldTrialPlugin
from cluster.worker_deaths import DeathRecorder, _DeathLog, death_cause
from det_tasks.errors import ConfigError
from flows.stopping import DEFAULT_STOP_GRACE_S, STOP_GRACE_ENV, StopControl, stop_grace_s


def _holding(experiment_key: str, idle_s: float) -> HeldTrialPlugin:
    plugin = HeldTrialPlugin()
    plugin.held = SimpleNamespace(spec=SimpleNamespace(experiment_run_key=experiment_key))  # type: ignore[assignment]
    plugin.last_step_end = time.monotonic() - idle_s
    return plugin


def test_plugins_are_installed_once_per_cluster() -> None:
    """Dask replaces a plugin registered again under its name by tearing the old one down,
    which released other experiments' held trials mid-step."""
    assert HeldTrialPlugin.idempotent is True
    assert DeathRecorder.idempotent is True


def test_a_step_does_not_evict_another_experiments_active_trial() -> None:
    plugin = _holding("experiment-a", idle_s=0.0)
    with pytest.raises(Reschedule):
        plugin.make_room_for(SimpleNamespace(experiment_run_key="experiment-b"))  # type: ignore[arg-type]
    assert plugin.foreign_active("experiment-b")
    assert not plugin.foreign_active("experiment-a")


def test_its_own_trials_and_an_idle_foreign_one_make_room() -> None:
    _holding("a", idle_s=0.0).make_room_for(SimpleNamespace(experiment_run_key="a"))  # type: ignore[arg-type]
    idle = _holding("a", idle_s=FOREIGN_ACTIVE_S + 1)
    idle.make_room_for(SimpleNamespace(experiment_run_key="b"))  # type: ignore[arg-type]
    assert not idle.foreign_active("b")


def test_workers_let_the_groups_signals_pass_but_their_children_do_not() -> None:
    """The shielded process carries on after SIGTERM and SIGINT; a process it forks (a
    trial's pool or DataLoader worker) still dies of SIGTERM, so ``Pool.terminate()`` and
    ``Popen.terminate()`` work in a trial (ignoring the signal was inherited and hung one)."""
    code = (
        "import multiprocessing as mp, os, signal, time\n"
        "from cluster.held_trials import shield_from_group_signals\n"
        "def wait():\n"
        "    time.sleep(60)\n"
        "shield_from_group_signals()\n"
        "child = mp.get_context('fork').Process(target=wait)\n"
        "child.start()\n"
        "time.sleep(0.5)\n"
        "child.terminate()\n"
        "child.join(10)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "print('alive', child.exitcode)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["alive", str(-signal.SIGTERM)]


def test_stop_grace_defaults_to_60_s_and_refuses_nonsense(monkeypatch) -> None:
    monkeypatch.delenv(STOP_GRACE_ENV, raising=False)
    assert stop_grace_s() == DEFAULT_STOP_GRACE_S == 60.0
    monkeypatch.setenv(STOP_GRACE_ENV, "2.5")
    assert stop_grace_s() == 2.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(STOP_GRACE_ENV, bad)
        with pytest.raises(ConfigError, match=f"{STOP_GRACE_ENV}='{bad}': expected a number"):
            stop_grace_s()


def test_a_stop_is_overdue_once_its_grace_has_passed() -> None:
    stop = StopControl(SimpleNamespace(), "key", None, "run")  # type: ignore[arg-type]
    assert not stop.overdue(0.0)  # nothing requested
    assert stop.request("pause")
    assert not stop.overdue(60.0)
    stop.requested_at = time.monotonic() - 61
    assert stop.overdue(60.0)
    assert stop.request("kill")  # a later request keeps the first one's time
    assert stop.overdue(60.0)


@pytest.mark.parametrize(
    ("exitcode", "says"),
    [
        (-signal.SIGKILL, "killed by signal 9 (SIGKILL): out of memory?"),
        (-signal.SIGSEGV, "killed by signal 11 (SIGSEGV): a crash in native code"),
        (3, "exited with code 3"),
        (None, "exit code unknown"),
    ],
)
def test_a_workers_exit_code_reads_as_its_likely_cause(exitcode, says) -> None:
    assert says in death_cause(exitcode)


def test_the_nannys_death_lines_are_kept_and_only_what_was_shown_is_passed_on() -> None:
    passed: list[logging.LogRecord] = []
    parent = logging.getLogger("distributed")
    catcher = logging.Handler()
    catcher.emit = passed.append  # type: ignore[method-assign]
    parent.addHandler(catcher)
    try:
        handler = _DeathLog(logging.ERROR)
        for level, text in [
            (logging.INFO, "Worker process 123 was killed by signal 9"),
            (logging.INFO, "Worker process 124 exited with status 3"),
            (logging.ERROR, "Failed to restart worker after its process exited"),
        ]:
            handler.emit(logging.LogRecord("distributed.nanny", level, "", 0, text, (), None))
    finally:
        parent.removeHandler(catcher)
    assert [(d["pid"], d["exitcode"]) for d in handler.deaths] == [(123, -9), (124, 3)]
    assert [r.getMessage() for r in passed] == ["Failed to restart worker after its process exited"]


def test_nannies_sharing_a_process_share_one_recorder_and_keep_its_quiet() -> None:
    """An embedded cluster's Nannies all live in the flow's process, whose Nanny logger is
    set to ERROR: the second Nanny's setup must not read the level the first one set."""
    logger = logging.getLogger("distributed.nanny")
    before = (logger.level, logger.propagate)
    logger.setLevel(logging.ERROR)
    try:
        first, second = DeathRecorder(), DeathRecorder()
        first.setup(None)  # type: ignore[arg-type]
        second.setup(None)  # type: ignore[arg-type]
        handlers = [h for h in logger.handlers if isinstance(h, _DeathLog)]
        assert len(handlers) == 1 and handlers[0].shown_from == logging.ERROR
        first.teardown(None)  # type: ignore[arg-type]
        assert logger.handlers.count(handlers[0]) == 1  # the other Nanny still uses it
        second.teardown(None)  # type: ignore[arg-type]
        assert handlers[0] not in logger.handlers
        assert (logger.level, logger.propagate) == (logging.ERROR, True)
    finally:
        logger.setLevel(before[0])
        logger.propagate = before[1]
