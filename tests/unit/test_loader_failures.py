"""A failure inside a DataLoader worker process points at the user's code: the user's
``__getitem__`` (file, line, record where known) first, the trial's own frames only, the
worker's own error line, and for a worker killed by a signal the signal and its likely
cause. Real exceptions, raised through a real torch DataLoader with a worker process, read
the way the flow (``cluster.held_trials.step_failure``) and ``det-tasks run`` print them.
"""

from __future__ import annotations

import importlib.util
import re
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from cluster.held_trials import step_failure
from det_tasks.runner import cli
from det_tasks.runner.held import HeldTrial, TrialSpec
from det_tasks.user_frames import UserFrame, error_text, innermost_user_frame, user_traceback

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "failing_loader"
GETITEM_RAISES = "model_def.py:24"  # the `raise ValueError(...)` line of Shards.__getitem__
WORKER_ERROR = "ValueError: shard 11 is corrupt (in DataLoader worker process 0)"


@pytest.fixture(autouse=True)
def _no_sigchld_handler_left_by_another_test() -> Iterator[None]:
    """torch installs its SIGCHLD handler once per process, in the first DataLoader
    iterated in the main thread; it then raises in the main thread, wherever it is, when any
    loader's worker dies. A Dask worker's steps iterate in other threads, so it has none."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGCHLD, previous)


def _model_def() -> ModuleType:
    from det_tasks import compat

    compat.install()  # model_def imports `determined`, as teams' trials do
    spec = importlib.util.spec_from_file_location("failing_loader_model_def", CASE / "model_def.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _failure(fail: str, workers: int = 1) -> BaseException:
    """What iterating the case's dataset through a torch DataLoader raises."""
    dataset = _model_def().Shards(32, fail, 11)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    return _raised_in_a_thread(list, loader)


def _raised_in_a_thread(function: Callable[..., Any], *args: Any) -> BaseException:
    """What ``function(*args)`` raises in a thread of a pool, as a Dask worker runs a step:
    its traceback starts at the pool's frame, not at this test's."""
    with ThreadPoolExecutor(1) as pool:
        err = pool.submit(function, *args).exception()
    assert err is not None
    return err


def test_a_workers_exception_names_the_users_getitem_and_its_own_error() -> None:
    err = _failure("raise")
    assert "Original Traceback" in str(err)  # torch's wrapper: the worker's traceback as text
    assert innermost_user_frame(err, CASE) == UserFrame("__getitem__", GETITEM_RAISES)
    assert error_text(err) == WORKER_ERROR
    shown = user_traceback(err, CASE).splitlines()
    assert shown[0] == "Traceback (the trial's code only):"
    files = re.findall(r'File "([^"]+)"', "\n".join(shown))
    assert files == ["model_def.py"]  # no torch, no platform
    assert shown[-3:] == [
        '  File "model_def.py", line 24, in __getitem__',
        '    raise ValueError(f"shard {i} is corrupt")',
        WORKER_ERROR,
    ]


def test_in_process_loading_names_the_record_index() -> None:
    err = _failure("raise", workers=0)
    frame = innermost_user_frame(err, CASE)
    assert frame == UserFrame("__getitem__", GETITEM_RAISES, record=11)
    assert frame.described == "__getitem__ (record 11)"
    assert error_text(err) == "ValueError: shard 11 is corrupt"
    assert "(record index 11)" in user_traceback(err, CASE)


@pytest.mark.parametrize(
    ("fail", "says"),
    [
        ("kill", "was killed by signal 9 (SIGKILL): out of memory? (the kernel's OOM killer"),
        ("bus", "was killed by signal 7 (SIGBUS): out of shared memory? (DataLoader workers pass"),
    ],
)
def test_a_worker_killed_by_a_signal_names_it_and_its_likely_cause(fail: str, says: str) -> None:
    err = _failure(fail)
    # torch's own words name no signal ("exited unexpectedly", or the broken pipe's error)
    assert "SIG" not in str(err)
    text = error_text(err)
    assert re.fullmatch(r"DataLoader worker process \(pid \d+\) " + re.escape(says) + ".*", text)
    if fail == "bus":
        assert "/dev/shm" in text


def _held_failure(tmp_path: Path, fail: str) -> str:
    """The flow's error block for the case's trial held as on a warm worker: its
    StepFailed's trial-only traceback and one line, as flows.experiment prints them."""
    spec = TrialSpec(
        config_path=str(CASE / "const.yaml"),
        model_dir=str(CASE),
        overrides=(
            f"data.fail={fail}",
            f"checkpoint_storage={{type: shared_fs, host_path: {tmp_path}}}",
        ),
        trial_id=1,
        hparams={"global_batch_size": 4, "lr": 0.1},
    )
    held = HeldTrial(spec)
    try:
        err = _raised_in_a_thread(held.train_to, 8)
        failure = step_failure(spec, "train", held.position, err)
    finally:
        held.close(None)
    return f"{failure.user_traceback}\nerror: {failure}"


def test_the_flows_block_starts_at_the_users_frame_and_holds_only_the_trials(
    tmp_path: Path,
) -> None:
    block = _held_failure(tmp_path, "raise")
    # Record 11 is in the third batch of four: two batches were trained.
    assert block.splitlines()[-1] == (
        f"error: trial 1 failed in __getitem__ at batch 2: {WORKER_ERROR} ({GETITEM_RAISES})"
    )
    assert block.splitlines()[:2] == [
        "Traceback (the trial's code only):",
        '  File "model_def.py", line 24, in __getitem__',
    ]
    assert "held_trials.py" not in block and "site-packages" not in block
    assert len(block.splitlines()) == 5


def test_the_flows_block_for_a_killed_worker_names_the_signal(tmp_path: Path) -> None:
    block = _held_failure(tmp_path, "kill")
    assert re.fullmatch(
        # batch 1 or 2: a batch the worker sent before it died may be lost with its pipe
        r"\nerror: trial 1 failed in train at batch [12]: DataLoader worker process \(pid \d+\) "
        r"was killed by signal 9 \(SIGKILL\): out of memory\?.*",
        block,
    )


def test_det_tasks_run_prints_the_users_frame_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", str(CASE / "const.yaml"), "--no-progress", "--checkpoint-dir", str(tmp_path)]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "Original Traceback" not in err and "site-packages" not in err
    assert err.rstrip().splitlines()[-1] == (
        f"error: {GETITEM_RAISES}: in __getitem__: {WORKER_ERROR}"
    )
    assert cli.main([*args, "--param", "data.fail=kill"]) == 1
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert re.fullmatch(
        r"error: DataLoader worker process \(pid \d+\) was killed by signal 9 \(SIGKILL\).*",
        last,
    )
