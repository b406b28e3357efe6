"""A checkpoint that meets a full disk is said in one line wherever it happens, and stops the
trial resumably: ENOSPC is found behind any wrapper, also in shutil.Error's list of
``(src, dst, why)`` tuples (copytree's way of reporting it); the local-files object store
reports it in one short line with nothing partial left; a flow's step turns it into a
non-retryable NoRoomForCheckpoint that crosses processes whole and ends the trial's run
PAUSED, not FAILED."""

from __future__ import annotations

import errno
import pickle
import shutil
from pathlib import Path

import pytest

from cluster.held_trials import ended_by, step_failure
from det_tasks.checkpoints.disk_full import (
    CheckpointSpaceFull,
    NoRoomForCheckpoint,
    no_space,
    os_error_text,
)
from det_tasks.errors import CheckpointError, TrialStopped
from det_tasks.runner.held import TrialSpec
from registry.servers.local_files import FileLocation
from tests.unit.test_disk_full import small_filesystem

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"


def _copytree_error(folder: str) -> shutil.Error:
    why = f"[Errno 28] No space left on device: '{folder}/.upload-x/state_dict.pth'"
    entries = [(f"/cache/{n}", f"{folder}/.upload-x/{n}", why) for n in ("state_dict.pth", "a")]
    return shutil.Error(entries)


def test_enospc_in_copytrees_list_is_a_full_disk_in_one_short_line() -> None:
    err = _copytree_error("/data/ckpt")
    assert err.errno is None  # what hid it from a plain errno check
    full = no_space(err)
    assert full is not None
    assert full.folder == "/data/ckpt"  # past the temporary .upload- folder
    assert full.why == "No space left on device"
    assert os_error_text(err) == "No space left on device"
    wrapped = CheckpointError("uploading checkpoint 1 failed")
    wrapped.__context__ = err
    assert no_space(wrapped) is not None
    other = shutil.Error([("/a", "/b", "[Errno 13] Permission denied: '/b'")])
    assert no_space(other) is None
    assert os_error_text(other) == "/b: [Errno 13] Permission denied: '/b'"
    assert no_space(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None


def test_the_errors_cross_processes_whole() -> None:
    full = CheckpointSpaceFull("/data/ckpt", 90, "abc", "No space left on device")
    back = pickle.loads(pickle.dumps(full))
    assert (back.folder, back.batch, back.previous, str(back)) == (
        "/data/ckpt",
        90,
        "abc",
        str(full),
    )
    room = NoRoomForCheckpoint(1, 92, "/data/ckpt", "No space left on device")
    again = pickle.loads(pickle.dumps(room.after_attempts(2)))
    assert isinstance(again, NoRoomForCheckpoint) and not again.retryable
    assert (again.folder, again.attempts, str(again)) == ("/data/ckpt", 2, str(room))
    assert str(room) == (
        "trial 1 stopped at batch 92: /data/ckpt is full (No space left on device); "
        "nothing partial was left"
    )


def test_a_flow_step_on_a_full_disk_pauses_its_trial_instead_of_failing_it() -> None:
    spec = TrialSpec(str(FLOW_MODEL / "killable.yaml"), str(FLOW_MODEL), (), 3, {})
    error = CheckpointError("uploading checkpoint 1 failed")
    error.__context__ = _copytree_error("/data/ckpt")
    failure = step_failure(spec, "train", 92, error)
    assert isinstance(failure, NoRoomForCheckpoint) and not failure.retryable
    assert failure.trial_id == 3 and failure.folder == "/data/ckpt"
    ending = ended_by(failure)
    assert isinstance(ending, TrialStopped) and ending.state == "PAUSED"
    plain = step_failure(spec, "train", 92, ValueError("bad"))
    assert ended_by(plain) is plain


def test_the_local_files_store_on_a_full_disk_says_one_line_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "state_dict.pth").write_bytes(b"\0" * (3 << 20))
    with small_filesystem(tmp_path / "disk", "2m") as disk:
        target = FileLocation(disk / "checkpoints" / "abc", disk)
        with pytest.raises(CheckpointSpaceFull) as err:
            target.upload_dir(source)
        message = str(err.value)
        assert len(message.splitlines()) == 1 and len(message) < 300, message
        assert f"{disk / 'checkpoints'} is full (No space left on device)" in message
        assert list((disk / "checkpoints").iterdir()) == []  # no .upload- folder left
