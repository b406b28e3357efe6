"""Disk full while writing a checkpoint (a 2 MiB tmpfs): the trial fails with an error that
says so and where, the previous checkpoint stays intact and loadable, and nothing partial is
left where checkpoints are published."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_tasks import CheckpointError
from det_tasks.checkpoints import format as checkpoint_format
from det_tasks.runner.in_process import run_trial

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"
CONFIG = FLOW_MODEL / "killable.yaml"


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "2m") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(root: Path, leave_bytes: int) -> None:
    """Use up the filesystem's free space but ``leave_bytes``."""
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    with open(root / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))


@pytest.fixture(autouse=True)
def _no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _train(root: Path, batches: int, resume: str | None = None):  # type: ignore[no-untyped-def]
    return run_trial(
        CONFIG,
        FLOW_MODEL,
        overrides=["hyperparameters.sleep_s=0", "min_checkpoint_period={batches: 30}"],
        checkpoint_dir=root,
        progress=False,
        max_batches=batches,
        latest_checkpoint=resume,
    )


def test_disk_full_during_checkpoint(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk") as disk:
        store = disk / "checkpoints"
        first = _train(store, 30)
        assert first.checkpoint_uuid is not None
        size = sum(p.stat().st_size for p in (store / first.checkpoint_uuid).rglob("*"))
        _fill(disk, leave_bytes=size // 3)

        with pytest.raises(CheckpointError) as err:
            _train(store, 60, resume=first.checkpoint_uuid)
        message = str(err.value)
        assert "No space left on device" in message and str(store) in message

        published = sorted(p.name for p in store.iterdir() if not p.name.startswith("."))
        assert published == [first.checkpoint_uuid]
        staging = store / ".staging"
        assert not staging.exists() or not any(staging.iterdir())
        meta = checkpoint_format.verify(store / first.checkpoint_uuid)
        assert meta["steps_completed"] == 30
        (disk / "filler").unlink()
        resumed = _train(store, 60, resume=first.checkpoint_uuid)
        assert resumed.batches_trained == 60
        assert (
            json.loads((store / resumed.checkpoint_uuid / "metadata.json").read_text())[
                "steps_completed"
            ]
            == 60
        )
