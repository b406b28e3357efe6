"""A model directory as one reproducible archive, and its safe unpacking on a worker.

``det-tasks experiment create CONFIG DIR`` ships DIR the way ``det experiment create`` did:
files matching ``.detignore`` (gitignore syntax) are left out, the archive is refused past a
size limit (96 MB, Determined's), and the bytes are deterministic (sorted names, fixed
times and owners) so identical code has an identical content hash and is uploaded once.
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

import pathspec

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

DEFAULT_MAX_BYTES = 96 * 1024 * 1024
# Credentials never leave the machine inside a package or a checkpoint's code/ copy.
SECRET_FILES = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_rsa*",
    "id_ecdsa*",
    "id_ed25519*",
    ".netrc",
    ".pgpass",
    ".git-credentials",
    ".aws/",
    ".ssh/",
    ".stack/",
]
ALWAYS_IGNORED = [".git/", "__pycache__/", "*.pyc", ".detignore~", *SECRET_FILES]


class PackageError(DetTasksError):
    """A model directory that cannot be shipped, or an archive that must not be unpacked."""


@dataclasses.dataclass(frozen=True)
class PackedModel:
    data: bytes
    sha256: str
    files: list[str]
    total_bytes: int


def _ignore_spec(model_dir: Path, extra: list[str] | None = None) -> pathspec.GitIgnoreSpec:
    lines = [*ALWAYS_IGNORED, *(extra or [])]
    detignore = model_dir / ".detignore"
    if detignore.is_file():
        lines += detignore.read_text(encoding="utf-8", errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def model_files(
    model_dir: Path,
    extra_ignored: list[str] | None = None,
    excluded_dirs: Sequence[Path] = (),
) -> list[tuple[str, Path]]:
    """(relative name, path) of every file a package or a checkpoint's code/ copy takes:
    minus ``.detignore`` matches, credentials (``SECRET_FILES``), ``extra_ignored`` and
    the folders ``excluded_dirs`` (checkpoint folders: matched by location, since a
    pattern cannot say "this ./ckpt, not a package's ckpt/")."""
    spec = _ignore_spec(model_dir, extra_ignored)
    excluded = _relative_dirs(model_dir, excluded_dirs)
    found: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(model_dir):
        rel_root = Path(root).relative_to(model_dir)
        dirs[:] = sorted(
            d
            for d in dirs
            if not spec.match_file(f"{(rel_root / d).as_posix()}/")
            and (rel_root / d).as_posix() not in excluded
        )
        for name in sorted(names):
            rel = (rel_root / name).as_posix()
            path = Path(root) / name
            if spec.match_file(rel) or not path.is_file():
                continue
            found.append((rel, path))
    return found


def _relative_dirs(model_dir: Path, dirs: Sequence[Path]) -> set[str]:
    """``dirs`` that lie inside ``model_dir``, as paths relative to it (links resolved)."""
    base = model_dir.resolve()
    inside = set()
    for folder in dirs:
        resolved = Path(folder).expanduser().resolve()
        if base in resolved.parents:
            inside.add(resolved.relative_to(base).as_posix())
    return inside


def pack_model_dir(
    model_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
    excluded_dirs: Sequence[Path] = (),
) -> PackedModel:
    """``model_dir`` (minus ``.detignore`` matches and ``excluded_dirs``, the config's
    checkpoint folders: ``det_tasks.config.storage_paths.code_exclusions``) as a
    deterministic ``.tar.gz``."""
    root = Path(model_dir)
    if not root.is_dir():
        raise PackageError(f"model directory {str(root)!r} does not exist or is not a folder")
    files = model_files(root, excluded_dirs=excluded_dirs)
    sizes = [(path.stat().st_size, rel) for rel, path in files]
    total = sum(size for size, _ in sizes)
    if total > max_bytes:
        largest = ", ".join(
            f"{rel} ({size / 2**20:.1f} MB)" for size, rel in sorted(sizes, reverse=True)[:5]
        )
        raise PackageError(
            f"model directory {str(root)!r} holds {total / 2**20:.1f} MB, over the "
            f"{max_bytes / 2**20:.0f} MB limit; largest files: {largest}. Add them to "
            f"{str(root / '.detignore')!r} (gitignore syntax) and load data from storage "
            "instead of shipping it with the code"
        )
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path in files:
            info = tarfile.TarInfo(rel)
            info.size = path.stat().st_size
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    return PackedModel(data, hashlib.sha256(data).hexdigest(), [rel for rel, _ in files], total)


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
