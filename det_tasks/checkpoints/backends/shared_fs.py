"""``checkpoint_storage.type: shared_fs``: checkpoints as ``<host_path>[/<storage_path>]/<uuid>``
directories, Determined's default layout. ``container_path`` and ``propagation`` are accepted
for Determined's configs and have no effect (there are no containers or bind mounts)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from det_tasks.checkpoints.backends import StorageBackend, StorageOptions

if TYPE_CHECKING:
    from det_tasks.checkpoints.store import CheckpointStore

__all__ = ["BACKEND", "SharedFSStorage"]


class SharedFSStorage(StorageOptions):
    type: Literal["shared_fs"]
    host_path: str
    storage_path: str | None = None
    container_path: str | None = None
    propagation: str | None = None


def _folder(section: Mapping[str, Any]) -> tuple[str, Path] | None:
    host, sub = section.get("host_path"), section.get("storage_path")
    if not isinstance(host, str):
        return None
    if isinstance(sub, str) and sub:
        return "host_path + storage_path", Path(host) / sub
    return "host_path", Path(host)


def _store(options: SharedFSStorage) -> CheckpointStore:
    from det_tasks.checkpoints.store import LocalDirectoryStore

    base = Path(options.host_path)
    return LocalDirectoryStore(base / options.storage_path if options.storage_path else base)


BACKEND = StorageBackend(options=SharedFSStorage, folder=_folder, local_store=_store)
