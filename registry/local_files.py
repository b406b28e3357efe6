"""A local directory standing in for an S3 prefix: where checkpoint bytes go when MLflow's
artifact root is a path (the no-server embedded mode), with the same guarantees as the S3
path: a checkpoint appears complete or not at all (copied aside, then renamed into place)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from det_tasks.errors import CheckpointError

__all__ = ["FileLocation"]


class FileLocation:
    """``file:///abs/path``: a directory whose files are the objects under a prefix."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()

    @property
    def uri(self) -> str:
        return self.path.as_uri()

    def child(self, relative: str) -> FileLocation:
        return FileLocation(self.path / relative)

    # The object-store operations, for registry.s3's functions to delegate to.

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
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"writing {self.path} failed: {err.strerror or err}") from None

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
