"""registry.servers.database_templates: the first database an installation builds becomes
the template, a later fresh home starts as a copy of it (with the creator's home rows gone),
and a template that is off, missing, corrupt or older than the package never stops a home
being built the slow way. The MLflow case is the real store: a seeded home makes its own
Default experiment in its own folder."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from registry.servers.database_templates import MLFLOW_TEMPLATE, DatabaseTemplate
from registry.servers.shared_database import create_once

TEMPLATE = DatabaseTemplate(
    "pytest", home_rows=("DELETE FROM rows WHERE home = 'creator'",)
)  # any installed package names a version


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DET_TASKS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DET_TASKS_DATABASE_TEMPLATES", raising=False)
    return tmp_path / "cache"


def _builder(database: Path, calls: list[str]):  # type: ignore[no-untyped-def]
    """What a package's first start does: migrations (the schema) when the file has none,
    then its own rows; records which of the two it had to do."""

    def build() -> None:
        connection = sqlite3.connect(database)
        has_schema = connection.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'rows'"
        ).fetchone() == (1,)
        if not has_schema:
            connection.execute("CREATE TABLE rows (home TEXT, schema_row INTEGER)")
            connection.execute("INSERT INTO rows VALUES ('schema', 1)")
        connection.execute("INSERT INTO rows VALUES ('creator', 0)")
        connection.commit()
        connection.close()
        calls.append("seeded" if has_schema else "migrated")

    return build


def _rows(database: Path) -> list[tuple[str, int]]:
    connection = sqlite3.connect(database)
    try:
        return sorted(connection.execute("SELECT home, schema_row FROM rows").fetchall())
    finally:
        connection.close()


def test_the_first_build_becomes_the_template_and_the_next_home_starts_from_it(
    tmp_path: Path, cache: Path
) -> None:
    first, second = tmp_path / "a" / "store.db", tmp_path / "b" / "store.db"
    calls: list[str] = []
    create_once(first, _builder(first, calls), TEMPLATE)
    template = TEMPLATE.path()
    assert template is not None and template.parent == cache / "database-templates"
    assert _rows(template) == [("schema", 1)]  # the creator's own row is not kept

    create_once(second, _builder(second, calls), TEMPLATE)
    assert calls == ["migrated", "seeded"]
    assert _rows(second) == [("creator", 0), ("schema", 1)]
    assert (second.parent / "store.db.ready").exists()
    assert [p.name for p in template.parent.iterdir()] == [template.name]  # no temp left


def test_a_template_never_replaces_a_database_that_is_there(tmp_path: Path) -> None:
    calls: list[str] = []
    create_once(tmp_path / "a.db", _builder(tmp_path / "a.db", calls), TEMPLATE)
    existing = tmp_path / "b.db"
    sqlite3.connect(existing).close()  # a database without the marker (a crashed creator)
    create_once(existing, _builder(existing, calls), TEMPLATE)
    assert calls == ["migrated", "migrated"]


@pytest.mark.parametrize("spoil", ["off", "corrupt"])
def test_off_or_corrupt_the_home_is_built_the_slow_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spoil: str
) -> None:
    calls: list[str] = []
    create_once(tmp_path / "a.db", _builder(tmp_path / "a.db", calls), TEMPLATE)
    template = TEMPLATE.path()
    assert template is not None
    if spoil == "off":
        monkeypatch.setenv("DET_TASKS_DATABASE_TEMPLATES", "0")
    else:
        template.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    fresh = tmp_path / "b.db"
    create_once(fresh, _builder(fresh, calls), TEMPLATE)
    assert calls == ["migrated", "migrated"]
    assert _rows(fresh) == [("creator", 0), ("schema", 1)]


def test_a_template_is_kept_per_package_version() -> None:
    import importlib.metadata

    path = MLFLOW_TEMPLATE.path()
    assert path is not None and path.name == f"mlflow-{importlib.metadata.version('mlflow')}.sqlite"
    assert DatabaseTemplate("no-such-package-here").path() is None


def test_a_seeded_mlflow_home_makes_its_own_default_experiment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from registry.runs.tracking import client_for

    stores = []
    for home in ("first", "second"):
        folder = tmp_path / home
        folder.mkdir()
        monkeypatch.chdir(folder)  # MLflow's Default experiment lives under the cwd
        database = folder / "mlflow.db"
        client = client_for(f"sqlite:///{database}")
        stores.append((folder, client.get_experiment("0").artifact_location))
        assert client.get_experiment_by_name("Default") is not None
    assert MLFLOW_TEMPLATE.path() is not None and MLFLOW_TEMPLATE.path().is_file()  # type: ignore[union-attr]
    for folder, location in stores:
        assert location == str(folder / "mlruns" / "0")
