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

from det_tasks.checkpoints.format import METADATA_FILE, verify
from det_tasks.errors import CheckpointError
from registry.servers.containment import ensure_contained
from registry.servers.s3 import Location, download_prefix, read_object

__all__ = ["fetch_checkpoint"]


def fetch_checkpoint(
    s3: Any, location: Location, cache_dir: Path, reference: str | None = None
) -> Path:
    """A verified local copy of the checkpoint stored under ``location``.

    Every remote checkpoint read (download, resume, batch inference,
    ``load_trial_from_checkpoint_path``) comes through here, so this is where a location that
    left its run's artifacts or its bucket prefix is refused, before anything is read or made.
    ``reference`` is what the user wrote, named in errors (the location's own text if None).
    """
    shown = reference if reference is not None else location.given
    ensure_contained(location, shown)
    metadata = read_object(s3, location, METADATA_FILE)
    if metadata is None:
        raise CheckpointError(
            f"{shown} holds no complete checkpoint ({METADATA_FILE} is missing at "
            f"{location.uri}: "
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
            raise CheckpointError(f"{shown} changed while it was being downloaded")
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
