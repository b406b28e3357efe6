"""A local directory standing in for an S3 prefix: where checkpoint bytes go when MLflow's
artifact root is a path (the no-server embedded mode), with the same guarantees as the S3
path: a checkpoint appears complete or not at all (copied aside, then renamed into place)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from det_tasks.checkpoints.disk_full import CheckpointSpaceFull, no_space, os_error_text
from det_tasks.errors import CheckpointError
from registry.servers.containment import Boundary

__all__ = ["FileLocation"]


class FileLocation:
    """``file:///abs/path``: a directory whose files are the objects under a prefix; it and
    every symbolic link in it must stay under ``root`` (the filesystem unless bounded)."""

    def __init__(
        self,
        path: str | Path,
        root: str | Path = "/",
        boundary: Boundary | None = None,
        given: str | None = None,
    ) -> None:
        self.given = given if given is not None else str(path)
        self.path = Path(path).expanduser().resolve()  # resolves ".." and symbolic links
        self.root = Path(root).expanduser().resolve()
        self.boundary = boundary or Boundary(
            "the filesystem", "file:///", "file:///abs/path/to/checkpoint"
        )

    @property
    def uri(self) -> str:
        return self.path.as_uri()

    def child(self, relative: str) -> FileLocation:
        """``relative`` below this directory (an absolute ``relative`` replaces it)."""
        given = f"{self.given.rstrip('/')}/{relative}"
        return FileLocation(self.path / relative, self.root, self.boundary, given)

    def bounded(self, boundary: Boundary) -> FileLocation:
        """This location as the boundary of everything derived from it."""
        return FileLocation(self.path, self.path, boundary, self.given)

    def escape(self) -> str | None:
        if not self.path.is_relative_to(self.root):
            return f"it resolves to {self.path}"
        for link in _links_under(self.path):
            name = link.relative_to(self.path).as_posix()
            try:
                target = link.resolve()
            except (OSError, RuntimeError):  # a loop
                return f"{name} in it is a symbolic link that resolves nowhere"
            if not target.is_relative_to(self.root):
                return f"{name} in it is a symbolic link to {target}"
        return None

    # The object-store operations, for registry.servers.s3's functions to delegate to.

    def upload_dir(self, local: Path) -> None:
        """Copy ``local`` beside the target, then rename it into place (atomic publish)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".upload-", dir=self.path.parent))
        except OSError as err:
            raise CheckpointError(
                f"cannot write under {self.path.parent}: {err.strerror}"
            ) from None
        try:
            shutil.copytree(local, tmp, dirs_exist_ok=True)
            if self.path.exists():
                shutil.rmtree(self.path)
            os.rename(tmp, self.path)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing partial is left
            full = no_space(err)
            if full is not None:  # the one wording of a full disk (det_tasks.checkpoints)
                raise CheckpointSpaceFull(str(self.path.parent), why=full.why) from None
            raise CheckpointError(f"writing {self.path} failed: {os_error_text(err)}") from None

    def files(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(
            p.relative_to(self.path).as_posix()
            for p in self.path.rglob("*")
            if p.is_file() and not p.is_symlink()
        )

    def download(self, dest: Path) -> list[str]:
        names = self.files()
        if not names:
            raise CheckpointError(f"nothing is stored at {self.uri}: check the URI")
        for name in names:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path / name, target)
        return names

    def read(self, relative: str) -> bytes | None:
        path = self.path / relative
        return path.read_bytes() if path.is_file() else None

    def write(self, data: bytes) -> None:
        """Write this location as one object (a file), atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".put-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.rename(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self) -> int:
        if not self.path.is_dir():
            existed = self.path.is_file()
            self.path.unlink(missing_ok=True)
            return int(existed)
        count = len(self.files())
        shutil.rmtree(self.path, ignore_errors=True)
        return count


def _links_under(directory: Path) -> list[Path]:
    """Every symbolic link below ``directory``, without following any."""
    links: list[Path] = []
    for parent, dirs, files in os.walk(directory, followlinks=False):
        links.extend(Path(parent, name) for name in (*dirs, *files))
    return [p for p in links if p.is_symlink()]
