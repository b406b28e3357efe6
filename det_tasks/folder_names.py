"""Folders named after what users name (an experiment, a job), kept inside their root.

A name is the user's text: ``../../../x``, ``a/b``, a NUL, 300 characters. Used as a path it
can leave the folder it was meant for, or fail as "File name too long" after training. So a
folder made from a name is one safe path component: the name's letters, digits, ``.``,
``_`` and ``-`` (the rest become ``_``; none of ``._-`` leading), cut to a bound, then a hash of the
whole name, so names that differ only in what was replaced still get different folders.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from det_tasks.errors import ConfigError

__all__ = ["MAX_FOLDER_NAME_BYTES", "checked_id", "folder_name", "folder_under"]

MAX_FOLDER_NAME_BYTES = 80  # far below NAME_MAX (255 bytes on Linux and macOS)
_HASH_CHARS = 12  # 48 bits of SHA-256: distinct names never meet in practice
_UNSAFE = re.compile(r"[^\w.-]+")  # \w: Unicode letters and digits, and "_"


def folder_name(name: str) -> str:
    """One path component for ``name``: ``<readable part>-<hash>``, at most
    MAX_FOLDER_NAME_BYTES bytes (UTF-8), never ``.``/``..``, no separator, no NUL."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    readable = _UNSAFE.sub("_", name).lstrip("._-").rstrip("_") or "name"
    room = MAX_FOLDER_NAME_BYTES - len(digest) - 1
    readable = readable.encode("utf-8", "ignore")[:room].decode("utf-8", "ignore")
    return f"{readable}-{digest}"


def folder_under(root: Path | str, name: str) -> Path:
    """``root``'s folder for ``name`` (resolved, not created). Raises ConfigError if it
    resolves outside ``root`` (a link planted at that name pointing elsewhere)."""
    base = Path(root).expanduser().resolve()
    folder = (base / folder_name(name)).resolve()
    if folder.parent != base:
        raise ConfigError(
            f"the folder for {name!r} under {base} resolves to {folder}, outside it: remove "
            f"the link {base / folder_name(name)}"
        )
    return folder


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def checked_id(value: str, where: str) -> str:
    """``value`` if it is safe as one path component as it is (an id that names a folder
    users are told about, such as a job's ``jobs/<id>``); else ConfigError naming
    ``where`` it came from and what an id may hold."""
    if _ID.fullmatch(value) is None:
        raise ConfigError(
            f"{where}={value!r} is not a usable id: use 1-128 letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (it names a folder)"
        )
    return value
