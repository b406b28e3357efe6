"""Where checkpoint bytes go: the ``CheckpointStore`` interface and a local-directory store.

A checkpoint is written into a staging directory, then published atomically under its
uuid: a reader never sees a half-written checkpoint. ``registry/`` implements the same
interface over S3 + MLflow.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid as uuid_lib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from det_tasks.checkpoints.format import seal
from det_tasks.errors import CheckpointError

__all__ = ["CheckpointStore", "LocalDirectoryStore"]


@runtime_checkable
class CheckpointStore(Protocol):
    def stage(self) -> Path:
        """A fresh, empty local directory, named by the new checkpoint's uuid, to write it
        into. Callbacks see this path (``on_checkpoint_write_end``), so it stays a readable
        copy of the checkpoint after publish, as Determined's shared_fs directory does."""

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        """Seal the staged directory (metadata.json with checksums, see ``seal``, written
        last as the commit marker) and make it a checkpoint; returns its uuid (the staged
        directory's name). May finish in the background."""

    def discard(self, staged: Path) -> None:
        """Drop a staged directory after a failed write."""

    def completed_uploads(self, wait: bool = False) -> list[str]:
        """Published checkpoints whose bytes are now stored (publish may upload in the
        background); each uuid is returned once. ``wait`` blocks for pending ones."""

    def restore(self, uuid: str) -> contextlib.AbstractContextManager[Path]:
        """A local directory holding the checkpoint's files, for the duration of the block."""

    def delete(self, uuid: str) -> None:
        """Remove a published checkpoint."""

    def uri(self, uuid: str) -> str:
        """How users and ``load_trial_from_checkpoint_path`` refer to the checkpoint."""


class LocalDirectoryStore:
    """Checkpoints as ``<root>/<uuid>/`` directories (Determined's shared_fs layout)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._published: list[str] = []

    def stage(self) -> Path:
        """``<root>/<uuid>``, written in place as Determined's shared_fs does; until publish
        seals it with metadata.json it is not listed as a checkpoint of the trial."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.root}: {err.strerror}; "
                "set checkpoint_storage to a writable path"
            ) from None
        path = self.root / str(uuid_lib.uuid4())
        path.mkdir()
        return path

    def publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        uuid = staged.name
        seal(staged, metadata)
        _fsync_tree(staged)
        _fsync_dir(self.root)
        self._published.append(uuid)
        return uuid

    def completed_uploads(self, wait: bool = False) -> list[str]:
        done, self._published = self._published, []
        return done

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    @contextlib.contextmanager
    def restore(self, uuid: str) -> Iterator[Path]:
        path = self.path_of(uuid)
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint {uuid!r} does not exist under {self.root}; "
                "list the directory for valid uuids"
            )
        yield path

    def path_of(self, uuid: str) -> Path:
        if not uuid or "/" in uuid or uuid.startswith("."):
            raise CheckpointError(f"{uuid!r} is not a checkpoint uuid")
        return self.root / uuid

    def delete(self, uuid: str) -> None:
        shutil.rmtree(self.path_of(uuid), ignore_errors=True)

    def uri(self, uuid: str) -> str:
        return str(self.path_of(uuid))


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
