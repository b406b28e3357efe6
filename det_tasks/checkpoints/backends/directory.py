"""``checkpoint_storage.type: directory``: checkpoints as ``<container_path>/<uuid>``
directories (Determined's storage for a path already mounted where the trial runs)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from det_tasks.checkpoints.backends import StorageBackend, StorageOptions

if TYPE_CHECKING:
    from det_tasks.checkpoints.store import CheckpointStore

__all__ = ["BACKEND", "DirectoryStorage"]


class DirectoryStorage(StorageOptions):
    type: Literal["directory"]
    container_path: str


def _folder(section: Mapping[str, Any]) -> tuple[str, Path] | None:
    path = section.get("container_path")
    return ("container_path", Path(path)) if isinstance(path, str) else None


def _store(options: DirectoryStorage) -> CheckpointStore:
    from det_tasks.checkpoints.store import LocalDirectoryStore

    return LocalDirectoryStore(options.container_path)


BACKEND = StorageBackend(options=DirectoryStorage, folder=_folder, local_store=_store)
