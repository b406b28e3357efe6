"""Where a config's local checkpoints go, checked before training: that the folder can be
written, and that it is not the model directory that every checkpoint copies.

A relative ``host_path`` is resolved against the working directory, as the local store
(``det_tasks.checkpoints.backends.store_from_config``) resolves it. The folder is checked only
where it is used, ``det-tasks run`` without MLflow: on the platform checkpoints go to the
artifact store, and a Determined config naming a cluster's ``host_path`` (``/mnt/...``)
must run there unchanged.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from det_tasks.checkpoints.backends import DEFAULT_CHECKPOINT_DIR, local_folder
from det_tasks.config.experiment import ExperimentConfig
from det_tasks.errors import ConfigError

__all__ = [
    "DEFAULT_CHECKPOINT_DIR",
    "check_checkpoint_storage",
    "check_storage_beside_code",
    "code_exclusions",
    "local_checkpoint_root",
]


def local_checkpoint_root(config: ExperimentConfig) -> tuple[str, Path] | None:
    """(the field that names it, the folder) of a storage type that writes to a local
    folder (shared_fs, directory); None for S3 or no storage."""
    return local_folder(config.checkpoint_storage)


def check_checkpoint_storage(config: ExperimentConfig, source: str) -> None:
    """Refuse a checkpoint folder that cannot be created or written (``/proc``, a read-only
    mount, a file), now rather than at the first checkpoint. It creates one empty folder
    and removes it at once: only a real write tells (root may write where mode bits say
    no; ``/proc`` refuses what ``os.access`` allows)."""
    found = local_checkpoint_root(config)
    if found is None:
        return
    field, folder = found
    problem = _unwritable(folder)
    if problem is not None:
        raise ConfigError(
            f"{source}: `{field}` = {str(folder)!r} cannot hold checkpoints: {problem}; "
            "point it at a folder you can write, e.g. ./checkpoints"
        )


def _unwritable(folder: Path) -> str | None:
    existing = folder
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
    except OSError as err:  # a name too long, a loop of links
        return f"{err.strerror or err}"
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".det-tasks-write-check-", dir=existing)
    except OSError as err:
        return f"creating a folder in {str(existing)!r} failed ({err.strerror or err})"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def check_storage_beside_code(
    config: ExperimentConfig, model_dir: Path, checkpoint_dir: str | Path | None = None
) -> None:
    """Refuse checkpoints written into the model directory itself: each checkpoint's
    ``code/`` copy would hold every earlier checkpoint (0.5 MB, 1, 2, 4... until the size
    limit). A subfolder is fine (the copies leave it out), and so is a folder above the
    model directory: checkpoints land beside the code, never in it (Determined's own
    examples use ``host_path: /tmp``)."""
    if checkpoint_dir is not None:
        field, folder = "--checkpoint-dir", Path(checkpoint_dir).expanduser().resolve()
    else:
        found = local_checkpoint_root(config)
        if found is None:
            return
        field, folder = found
    if folder == model_dir.expanduser().resolve():
        raise ConfigError(
            f"`{field}` = {str(folder)!r} is the model directory itself: every checkpoint "
            "would copy the ones before it with the code; use a subfolder such as "
            "./checkpoints, which the code copies leave out"
        )


def code_exclusions(raw_config: Mapping[str, Any] | None, model_dir: Path) -> list[Path]:
    """The checkpoint folders inside ``model_dir`` that packages and checkpoints' ``code/``
    copies must leave out: the config's (``raw_config``, validated or not, e.g. a
    checkpoint's ``experiment_config``) and the default ``checkpoints``."""
    code = model_dir.expanduser().resolve()
    storage = (raw_config or {}).get("checkpoint_storage")
    found = local_folder(storage) if isinstance(storage, Mapping) else None
    folders = [Path(DEFAULT_CHECKPOINT_DIR).resolve()] + ([found[1]] if found else [])
    return [f for f in dict.fromkeys(folders) if code in f.parents]
