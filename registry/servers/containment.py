"""Keeping a checkpoint reference inside the place it names.

``runs:/<run>/checkpoints/../../../x`` reads as a path under a run's artifacts but
normalises to somewhere else, and the registry would copy whatever it found there. So each
location remembers the boundary it was derived from (a run's artifact root, the configured
bucket prefix, the bucket) and ``ensure_contained`` refuses one that left it, before any
byte is read or any directory is made.
"""

from __future__ import annotations

import dataclasses
import posixpath
import urllib.parse
from typing import Protocol

from det_tasks.errors import CheckpointError

__all__ = [
    "Boundary",
    "Contained",
    "ensure_contained",
    "fully_decoded",
    "key_within",
    "normalised_key",
]

# More rounds than any real name needs; a name still changing after them is refused as is.
_DECODE_ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What a location must stay inside, in words a user can act on."""

    what: str  # e.g. "the run's artifact root"
    uri: str  # where that is
    example: str  # what a valid reference looks like


class Contained(Protocol):
    """A location that knows its boundary and whether it left it."""

    @property
    def boundary(self) -> Boundary: ...

    def escape(self) -> str | None:
        """How the location leaves its boundary, or None when it stays inside."""


def fully_decoded(text: str) -> str:
    """``text`` with percent-encoding undone until nothing changes (``%252e`` -> ``.``), so
    an encoded ``..`` is judged as the ``..`` a server that decodes it would see."""
    for _ in range(_DECODE_ROUNDS):
        decoded = urllib.parse.unquote(text)
        if decoded == text:
            break
        text = decoded
    return text


def normalised_key(key: str) -> str:
    """An object key (relative to the bucket, whatever its leading slashes) with ``.``,
    ``..`` and repeated slashes resolved; one that climbs above the bucket keeps its leading
    ``..``."""
    cleaned = posixpath.normpath(key.lstrip("/")).rstrip("/") if key.strip("/") else "."
    return "" if cleaned == "." else cleaned


def key_within(key: str, root: str) -> bool:
    """Whether the normalised ``key`` is ``root`` or below it (``root`` "" is the bucket)."""
    if key == ".." or key.startswith("../"):
        return False
    return not root or key == root or key.startswith(root + "/")


def ensure_contained(location: Contained, reference: str) -> None:
    """Refuse, in one line naming ``reference``, a location that left its boundary."""
    why = location.escape()
    if why is None:
        return
    edge = location.boundary
    raise CheckpointError(
        f"{reference!r} leaves {edge.what} ({edge.uri}): {why}; "
        f"a valid reference looks like {edge.example}"
    )
