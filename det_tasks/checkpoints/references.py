"""Turning checkpoint references (paths, ``s3://``, ``models:/``, ``runs:/``) into directories.

det_tasks resolves local paths itself; other schemes are served by resolvers that other
packages (``registry/``) register, found through the ``det_tasks.checkpoint_resolvers``
entry-point group, so this package never imports them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from det_tasks import plugins
from det_tasks.errors import CheckpointError, DetTasksError

__all__ = ["open_checkpoint_uri", "register_resolver", "scheme_of"]

Resolver = Callable[[str], contextlib.AbstractContextManager[Path]]
_RESOLVERS: dict[str, Resolver] = {}


def register_resolver(scheme: str, resolver: Resolver) -> None:
    """Let ``scheme://...`` references resolve through ``resolver`` (a context manager)."""
    _RESOLVERS[scheme] = resolver


def scheme_of(reference: str) -> str | None:
    head, sep, _ = reference.partition(":")
    if not sep or len(head) < 2 or "/" in head or os.sep in head:
        return None  # a plain path, or a Windows drive letter
    return head.lower()


def _discover(scheme: str) -> Resolver | None:
    found = plugins.load_one("det_tasks.checkpoint_resolvers", scheme)
    if found is not None:
        register_resolver(scheme, found)
    return _RESOLVERS.get(scheme)


@contextlib.contextmanager
def open_checkpoint_uri(reference: str) -> Iterator[Path]:
    """A local directory holding the referenced checkpoint, for the block's duration."""
    scheme = scheme_of(reference)
    if scheme in (None, "file"):
        path = Path(reference.removeprefix("file://")).expanduser()
        if not path.exists():
            raise CheckpointError(f"checkpoint path {reference!r} does not exist")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {reference!r} is not a directory")
        yield path
        return
    assert scheme is not None
    resolver = _RESOLVERS.get(scheme) or _discover(scheme)
    if resolver is None:
        raise CheckpointError(
            f"checkpoint reference {reference!r} uses the {scheme!r} scheme, which nothing "
            "here can resolve: use a local directory, or install the platform extra "
            "(pip install '.[platform]') for s3://, models:/ and runs:/ references"
        )
    with contextlib.ExitStack() as opened:
        try:
            path = opened.enter_context(resolver(reference))
        except DetTasksError as err:
            # The resolver explained the mistake; its own frames are not the user's code,
            # so the CLI must not point at them as the place to fix.
            raise err.with_traceback(None) from None
        yield path
