"""A fresh home's SQLite databases copied from a template instead of built by migrations.

Why: the first run in a new home builds Prefect's and MLflow's SQLite schemas by running
every migration of each (~6.5 and ~3 CPU-seconds on a 2-core VM): a third of a 1-batch
experiment's CPU, paid again by every new home (a project, a test, a CI job). The schema
depends only on the package's version, so the first database an installation builds is kept,
emptied of rows that belong to one home, under the det-tasks cache
(``$DET_TASKS_CACHE_DIR/database-templates/<package>-<version>.sqlite``); later fresh homes
start from a copy, and the package's own start-up still runs on it (its migrations find
nothing to do; MLflow makes the home's own Default experiment). ``DET_TASKS_DATABASE_TEMPLATES=0``
turns it off. Anything wrong with a template (unreadable, failing SQLite's check) means the
home is built the slow way, never that it fails.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from registry.servers.settings import cache_dir

__all__ = ["MLFLOW_TEMPLATE", "PREFECT_TEMPLATE", "DatabaseTemplate"]

_logger = logging.getLogger(__name__)

SWITCH_ENV = "DET_TASKS_DATABASE_TEMPLATES"


@dataclass(frozen=True)
class DatabaseTemplate:
    """The schema of ``package``'s SQLite database at its installed version; ``home_rows``
    are the statements that remove what one home's first start wrote (run on the copy)."""

    package: str
    home_rows: tuple[str, ...] = ()

    def path(self) -> Path | None:
        """Where this installation keeps the template (None: templates are off, or the
        package is not installed)."""
        if os.environ.get(SWITCH_ENV, "1") == "0":
            return None
        try:
            version = importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None
        return cache_dir() / "database-templates" / f"{self.package}-{version}.sqlite"

    def seed(self, database: Path) -> bool:
        """Put a copy of the template at ``database`` when nothing is there yet; whether it
        did. The copy lands whole or not at all (written beside it, then renamed)."""
        template = self.path()
        if template is None or not template.is_file() or _exists_with_sidecars(database):
            return False
        try:
            database.parent.mkdir(parents=True, exist_ok=True)
            with _sibling_temp(database) as staged:
                shutil.copyfile(template, staged)
                if not _sound(staged):
                    _logger.info("database template %s fails SQLite's check: not used", template)
                    return False
                os.replace(staged, database)
            return True
        except (OSError, sqlite3.Error) as err:
            _logger.info("database template %s not used: %s", template, err)
            return False

    def save(self, database: Path) -> None:
        """Keep ``database``, just built by the package's own start, as this version's
        template (a consistent snapshot through SQLite's backup, its home rows removed,
        renamed into place), unless one is there already."""
        template = self.path()
        if template is None or template.exists():
            return
        try:
            template.parent.mkdir(parents=True, exist_ok=True)
            with _sibling_temp(template) as staged:
                source = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
                target = sqlite3.connect(staged)
                try:
                    source.backup(target)
                    target.execute("PRAGMA journal_mode=DELETE")  # one file, no -wal beside it
                    for statement in self.home_rows:
                        target.execute(statement)
                    target.commit()
                    target.execute("VACUUM")
                finally:
                    target.close()
                    source.close()
                os.replace(staged, template)
        except (OSError, sqlite3.Error) as err:
            _logger.info("could not keep %s as a database template: %s", database, err)


def _exists_with_sidecars(database: Path) -> bool:
    return any(
        database.with_name(database.name + suffix).exists() for suffix in ("", "-wal", "-journal")
    )


def _sound(path: Path | str) -> bool:
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return connection.execute("PRAGMA quick_check").fetchone() == ("ok",)
    finally:
        connection.close()


@contextlib.contextmanager
def _sibling_temp(path: Path) -> Iterator[str]:
    """A temporary file name beside ``path`` (the same file system, so a rename is atomic),
    removed if it is still there afterwards."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield name
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


# Prefect's first start writes only the schema and its built-in block types (the same for
# every home of a version). MLflow's writes its Default experiment, whose artifact folder is
# the creating process's working directory: removed, so each home's store makes its own.
PREFECT_TEMPLATE = DatabaseTemplate("prefect")
MLFLOW_TEMPLATE = DatabaseTemplate(
    "mlflow",
    home_rows=(
        "DELETE FROM experiment_tags WHERE experiment_id = 0",
        "DELETE FROM experiments WHERE experiment_id = 0",
    ),
)
