"""Checkpoint storage backends are a registry keyed by ``checkpoint_storage.type``
(det_tasks.checkpoints.backends): each type's own model checks its fields with the config's
one-line errors, and its store is what a trial without the platform writes to. A backend
added from outside the package (one module, one entry point) works like the built-in ones."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from det_tasks.checkpoints.backends import (
    STORAGE_BACKENDS,
    StorageBackend,
    find_backend,
    local_folder,
    store_from_config,
)
from det_tasks.checkpoints.backends.directory import DirectoryStorage
from det_tasks.checkpoints.backends.shared_fs import SharedFSStorage
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.config import parse_config
from det_tasks.config.storage_paths import check_checkpoint_storage, local_checkpoint_root
from det_tasks.errors import ConfigError
from det_tasks.plugins import _entries, entry_names

BACKEND_MODULE = """
from pathlib import Path
from typing import Literal

from pydantic import Field

from det_tasks.checkpoints.backends import StorageBackend, StorageOptions


class ShardedStorage(StorageOptions):
    type: Literal["sharded"]
    root: str
    shards: int = Field(default=2, ge=1)


def folder(section):
    root = section.get("root")
    return ("root", Path(root) / "shards") if isinstance(root, str) else None


def local_store(options):
    from det_tasks.checkpoints.store import LocalDirectoryStore

    return LocalDirectoryStore(Path(options.root) / "shards")


BACKEND = StorageBackend(options=ShardedStorage, folder=folder, local_store=local_store)
NOT_A_BACKEND = object()
"""


@pytest.fixture
def sharded_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``sharded`` storage type, installed as a third party's distribution would be."""
    (tmp_path / "sharded_storage.py").write_text(textwrap.dedent(BACKEND_MODULE))
    dist = tmp_path / "sharded_storage-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sharded-storage\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{STORAGE_BACKENDS}]\nsharded = sharded_storage:BACKEND\n"
        "broken = sharded_storage:NOT_A_BACKEND\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _entries.cache_clear()
    yield
    _entries.cache_clear()


def _config(storage: Any) -> dict[str, Any]:
    return {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {"global_batch_size": 8},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 8}},
        "checkpoint_storage": storage,
    }


def _error(storage: Any) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(_config(storage), "c.yaml")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_each_built_in_type_is_one_entry_point_naming_its_own_model() -> None:
    assert sorted(entry_names(STORAGE_BACKENDS)) == ["directory", "s3", "shared_fs"]
    for kind in entry_names(STORAGE_BACKENDS):
        backend = find_backend(kind)
        assert isinstance(backend, StorageBackend)
        assert backend.options.model_validate(_minimal(kind)).type == kind


def _minimal(kind: str) -> dict[str, Any]:
    return {
        "shared_fs": {"type": "shared_fs", "host_path": "/a"},
        "directory": {"type": "directory", "container_path": "/b"},
        "s3": {"type": "s3", "bucket": "bkt"},
    }[kind]


def test_a_section_is_its_types_model_and_dumps_whole(tmp_path: Path) -> None:
    storage = {"type": "shared_fs", "host_path": str(tmp_path), "storage_path": "sub"}
    config = parse_config(_config({**storage, "save_trial_latest": 3}))
    assert isinstance(config.checkpoint_storage, SharedFSStorage)
    assert config.checkpoint_storage.save_trial_latest == 3
    dumped = config.model_dump(mode="json")["checkpoint_storage"]
    assert dumped["host_path"] == str(tmp_path) and dumped["storage_path"] == "sub"
    assert parse_config(config.model_dump(mode="json", exclude_none=True)) == config


def test_an_unknown_type_names_the_field_the_value_and_the_known_types() -> None:
    assert _error({"type": "nfs", "host_path": "/x"}) == (
        "c.yaml: `checkpoint_storage.type` = 'nfs' is not a storage type; known types: "
        "directory, s3, shared_fs (a package adds one as a det_tasks.checkpoint_storage "
        "entry point)"
    )
    assert "did you mean 'shared_fs'?" in _error({"type": "sharedfs", "host_path": "/x"})
    assert "Determined's gcs storage is not supported here, use 's3'" in _error(
        {"type": "gcs", "bucket": "b"}
    )
    assert "`checkpoint_storage.type` is missing: say where checkpoints go, one of " in _error(
        {"host_path": "/x"}
    )


def test_a_types_own_fields_are_checked_with_the_configs_errors() -> None:
    assert _error({"type": "shared_fs", "host_pth": "/x"}) == (
        "c.yaml: required field `checkpoint_storage.host_path` is missing; unknown field "
        "`checkpoint_storage.host_pth`; did you mean `host_path`?"
    )
    assert _error({"type": "directory", "container_path": "/x", "bucket": "bkt"}) == (
        "c.yaml: unknown field `checkpoint_storage.bucket`; allowed fields here: type, "
        "save_experiment_best, save_trial_best, save_trial_latest, container_path"
    )
    assert "`checkpoint_storage.bucket` = 'b' is invalid" in _error({"type": "s3", "bucket": "b"})


def test_the_local_store_is_the_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shared = {"type": "shared_fs", "host_path": str(tmp_path / "h"), "storage_path": "s"}
    store = store_from_config({"checkpoint_storage": shared})
    assert isinstance(store, LocalDirectoryStore) and store.root == tmp_path / "h" / "s"
    directory = DirectoryStorage(type="directory", container_path=str(tmp_path / "d"))
    store = store_from_config({"checkpoint_storage": directory})
    assert isinstance(store, LocalDirectoryStore) and store.root == tmp_path / "d"
    default = store_from_config({})
    assert isinstance(default, LocalDirectoryStore) and default.root == tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match=r"^checkpoint_storage type 's3' needs the registry"):
        store_from_config({"checkpoint_storage": {"type": "s3", "bucket": "bkt"}})
    # a mapping given to fit(), not read through the loader: one line naming the field
    with pytest.raises(ConfigError, match=r"^`checkpoint_storage.host_path` is invalid: Field"):
        store_from_config({"checkpoint_storage": {"type": "shared_fs"}})


def test_a_raw_section_names_its_folder_validated_or_not(tmp_path: Path) -> None:
    """A checkpoint's experiment_config (maybe Determined's, with types this project lacks)
    is read as written: its folder, or none."""
    raw = {"type": "shared_fs", "host_path": str(tmp_path), "checkpoint_path": "extra"}
    assert local_folder(raw) == ("checkpoint_storage.host_path", tmp_path.resolve())
    assert local_folder({"type": "gcs", "bucket": "b"}) is None
    assert local_folder({"type": "s3", "bucket": "bkt"}) is None
    assert local_folder(None) is None


def test_a_backend_from_outside_the_package(sharded_backend: None, tmp_path: Path) -> None:
    config = parse_config(_config({"type": "sharded", "root": str(tmp_path), "shards": 4}))
    options = config.checkpoint_storage
    assert type(options).__name__ == "ShardedStorage" and options.shards == 4  # type: ignore[union-attr]
    assert options is not None and options.save_trial_best == 1  # the fields every type has
    assert "sharded" in _error({"type": "nfs"})  # listed among the known types
    assert _error({"type": "sharded", "root": "/r", "shards": 0}) == (
        "c.yaml: `checkpoint_storage.shards` = 0 is invalid: Input should be greater than or "
        "equal to 1"
    )
    assert "did you mean `shards`?" in _error({"type": "sharded", "root": "/r", "shard": 2})
    assert local_checkpoint_root(config) == (
        "checkpoint_storage.root",
        (tmp_path / "shards").resolve(),
    )
    check_checkpoint_storage(config, "c.yaml")  # writable
    store = store_from_config(config.model_dump())
    staged = store.stage()
    (staged / "state.txt").write_text("7")
    uuid = store.publish(staged, {"steps_completed": 1})
    assert (tmp_path / "shards" / uuid / "state.txt").read_text() == "7"
    with store.restore(uuid) as path:
        assert (path / "state.txt").read_text() == "7"


def test_an_entry_point_naming_something_else_is_refused(sharded_backend: None) -> None:
    assert _error({"type": "broken"}) == (
        "c.yaml: `checkpoint_storage.type` = 'broken': its det_tasks.checkpoint_storage entry "
        "point names a object, not a det_tasks.checkpoints.backends.StorageBackend"
    )
