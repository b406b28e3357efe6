"""Creating a shared local database once, whoever comes first.

Two experiments started together in a fresh home both find no MLflow or Prefect SQLite
database and both create its schema; one of them then fails ("table ... already exists",
or an alembic version mismatch). Whoever comes first creates it under an exclusive file
lock and leaves a marker beside it; everyone after sees the marker and goes on unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path

from registry.servers.database_templates import DatabaseTemplate

__all__ = ["create_once", "exclusive"]


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing); the kernel
    drops it if this process dies, so a crashed creator never blocks the next one."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def create_once(
    database: Path, create: Callable[[], None], template: DatabaseTemplate | None = None
) -> None:
    """Run ``create`` (which makes ``database`` usable) unless a marker says it already
    was; concurrent callers wait for the first one instead of racing it. With a
    ``template``, a database not there yet starts as a copy of the installation's template
    of that schema (``create`` then finds its migrations done), and the first one built
    without it becomes that template."""
    marker = database.with_name(database.name + ".ready")
    if marker.exists():
        return
    with exclusive(database.with_name(database.name + ".lock")):
        if marker.exists():
            return
        seeded = template is not None and template.seed(database)
        create()
        if template is not None and not seeded:
            template.save(database)
        marker.touch()
