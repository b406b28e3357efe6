"""A model directory as one reproducible archive, and its safe unpacking on a worker.

``det experiment create CONFIG DIR`` ships DIR the way Determined's did, and ``python -m
flows.experiment`` snapshots it the same way (registry.experiments.code_snapshot): only the model
definition goes in (det_tasks.checkpoints.code_selection: ``.detignore``, never the
platform's homes, databases or checkpoints), refused past Determined's 95 MB, and the
bytes are deterministic (sorted names, fixed times and owners) so identical code has an
identical content hash and is uploaded once.
Unpacking refuses absolute paths, ``..``, links and devices: an archive can only create
regular files and folders under the destination.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

from det_tasks.checkpoints.code_selection import (
    MAX_MODEL_DEF_BYTES,
    SECRET_FILES,
    model_files,
    over_limit,
    sized,
)
from det_tasks.errors import DetTasksError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SECRET_FILES",
    "PackageError",
    "PackedModel",
    "model_files",
    "pack_model_dir",
    "unpack_model_package",
]

DEFAULT_MAX_BYTES = MAX_MODEL_DEF_BYTES


class PackageError(DetTasksError):
    """A model directory that cannot be shipped, or an archive that must not be unpacked."""


@dataclasses.dataclass(frozen=True)
class PackedModel:
    data: bytes
    sha256: str
    files: list[str]
    total_bytes: int


def pack_model_dir(
    model_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
    excluded_dirs: Sequence[Path] = (),
) -> PackedModel:
    """``model_dir``'s model definition (det_tasks.checkpoints.code_selection; ``excluded_dirs``:
    the config's checkpoint folders, ``det_tasks.config.storage_paths.code_exclusions``) as
    a deterministic ``.tar.gz``; a file that vanishes meanwhile is left out."""
    root = Path(model_dir)
    if not root.is_dir():
        raise PackageError(f"model directory {str(root)!r} does not exist or is not a folder")
    files = sized(model_files(root, excluded_dirs=excluded_dirs))
    refusal = over_limit(root, files, max_bytes)
    if refusal:
        raise PackageError(refusal)
    raw = io.BytesIO()
    packed: list[tuple[str, int]] = []
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, _ in files:
            body = _read(path)
            if body is None:
                continue
            info = tarfile.TarInfo(rel)
            info.size = len(body)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(body))
            packed.append((rel, len(body)))
    data = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    names, total = [rel for rel, _ in packed], sum(n for _, n in packed)
    return PackedModel(data, hashlib.sha256(data).hexdigest(), names, total)


def _read(path: Path) -> bytes | None:
    """The file's bytes; None when it vanished (or became a folder) since it was listed."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def unpack_model_package(archive: str | Path, destination: str | Path) -> Path:
    """Extract ``archive`` into ``destination`` (created), refusing anything unsafe."""
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member, archive)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise PackageError(f"model package {str(archive)!r} is unreadable: {err}") from None
    return dest


def _check_member(member: tarfile.TarInfo, archive: str | Path) -> None:
    name = member.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts:
        raise PackageError(
            f"model package {str(archive)!r} holds {name!r}, a path outside its folder: refused"
        )
    if not (member.isfile() or member.isdir()):
        raise PackageError(
            f"model package {str(archive)!r} holds {name!r}, a link or special file: refused"
        )
