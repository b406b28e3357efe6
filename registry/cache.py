"""Remote checkpoints, downloaded once into a content-addressed cache.

The cache key is the sha256 of the checkpoint's ``metadata.json`` (which lists every
file's sha256), so two URIs for the same bytes share one copy and a changed checkpoint
never reads a stale one. Downloads land in a temporary directory and are renamed into
place, so a crash mid-download leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from det_tasks.checkpoint_format import METADATA_FILE, verify
from det_tasks.errors import CheckpointError
from registry.s3 import Location, download_prefix, read_object

__all__ = ["fetch_checkpoint"]


def fetch_checkpoint(s3: Any, location: Location, cache_dir: Path) -> Path:
    """A verified local copy of the checkpoint stored under ``location``."""
    metadata = read_object(s3, location, METADATA_FILE)
    if metadata is None:
        raise CheckpointError(
            f"{location.uri} holds no complete checkpoint ({METADATA_FILE} is missing: "
            "it was never written, is still uploading, or was deleted)"
        )
    key = hashlib.sha256(metadata).hexdigest()
    target = cache_dir / "checkpoints" / key
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        download_prefix(s3, location, tmp)
        if hashlib.sha256((tmp / METADATA_FILE).read_bytes()).hexdigest() != key:
            raise CheckpointError(f"{location.uri} changed while it was being downloaded")
        verify(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # lost a race with another download of the same bytes
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
