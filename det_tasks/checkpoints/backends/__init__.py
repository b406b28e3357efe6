"""Checkpoint storage backends, keyed by ``checkpoint_storage.type``: one module each
(``shared_fs``, ``directory``, ``s3`` here), each registered as a ``det_tasks.checkpoint_storage``
entry point that names its ``StorageBackend``.

A backend brings its own config fields (a ``StorageOptions`` model, as strict as the rest of
the config, with the same one-line errors), the local folder it writes to (checked before
training) and the store it builds when a trial runs without the platform. On the platform
(``MLFLOW_TRACKING_URI`` set) every type's checkpoints are artifacts of the trial's MLflow
run (``registry.checkpoints.store.S3CheckpointStore``) and only the ``save_*`` counts apply. A
new backend is one module and one entry point line; the registry looks a type up when a
config names it, so a package installed later adds its type to processes started after it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from det_tasks.errors import ConfigError
from det_tasks.plugins import entry_names, load_one

if TYPE_CHECKING:
    from det_tasks.checkpoints.store import CheckpointStore

__all__ = [
    "DEFAULT_CHECKPOINT_DIR",
    "STORAGE_BACKENDS",
    "StorageBackend",
    "StorageOptions",
    "find_backend",
    "local_folder",
    "options_model",
    "parse_storage",
    "store_from_config",
]

STORAGE_BACKENDS = "det_tasks.checkpoint_storage"
# Where a config without checkpoint_storage checkpoints.
DEFAULT_CHECKPOINT_DIR = "checkpoints"
# Determined's types that no backend here implements, and what to use instead.
_DETERMINED_ONLY = {"gcs": "s3", "azure": "s3"}


class StorageOptions(BaseModel):
    """A ``checkpoint_storage`` section: the fields every type has (Determined's retention
    counts). A backend's model subclasses it with ``type: Literal["<its type>"]`` and its
    own fields; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    type: str
    save_experiment_best: int = Field(default=0, ge=0)
    save_trial_best: int = Field(default=1, ge=0)
    save_trial_latest: int = Field(default=1, ge=0)


@dataclasses.dataclass(frozen=True)
class StorageBackend:
    """What a ``det_tasks.checkpoint_storage`` entry point names.

    ``options`` validates the section; ``folder(section)`` reads a raw section (validated or
    not) for (the fields that name it, the local folder checkpoints go to), None when it
    names none; ``local_store(options)`` builds the store a trial uses without the platform,
    and is None when the type needs the platform's store (its error says so)."""

    options: type[StorageOptions]
    folder: Callable[[Mapping[str, Any]], tuple[str, Path] | None] | None = None
    local_store: Callable[[Any], CheckpointStore] | None = None


def find_backend(kind: str) -> StorageBackend:
    """The backend registered as ``kind``, or a one-line ConfigError naming the field, the
    value and the known types."""
    try:
        found = load_one(STORAGE_BACKENDS, kind)
    except ImportError as err:
        missing = getattr(err, "name", None) or kind
        raise ConfigError(
            f"`checkpoint_storage.type` = {kind!r} needs the {missing!r} package, which is "
            "not installed; install it or use another type"
        ) from None
    if isinstance(found, StorageBackend):
        return found
    if found is not None:
        raise ConfigError(
            f"`checkpoint_storage.type` = {kind!r}: its {STORAGE_BACKENDS} entry point names "
            f"a {type(found).__name__}, not a det_tasks.checkpoints.backends.StorageBackend"
        )
    raise ConfigError(_unknown(kind))


def _unknown(kind: str) -> str:
    known = sorted(entry_names(STORAGE_BACKENDS))
    if kind in _DETERMINED_ONLY:
        hint = (
            f"Determined's {kind} storage is not supported here, use {_DETERMINED_ONLY[kind]!r}; "
        )
    else:
        close = difflib.get_close_matches(kind, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"`checkpoint_storage.type` = {kind!r} is not a storage type; {hint}known types: "
        f"{_listed(known)}"
    )


def _listed(known: list[str]) -> str:
    return f"{', '.join(known) or 'none'} (a package adds one as a {STORAGE_BACKENDS} entry point)"


def parse_storage(section: Any) -> Any:
    """A raw ``checkpoint_storage`` mapping validated by its type's own model (the config
    model's validator; pydantic reports its errors under ``checkpoint_storage.<field>``).
    Anything else is returned for the config model to refuse."""
    if not isinstance(section, Mapping):
        return section
    kind = section.get("type")
    if not isinstance(kind, str):
        said = "is missing" if kind is None else f"= {kind!r} is not a type name"
        known = _listed(sorted(entry_names(STORAGE_BACKENDS)))
        raise ValueError(
            f"`checkpoint_storage.type` {said}: say where checkpoints go, one of {known}"
        )
    return find_backend(kind).options.model_validate(dict(section))


def options_model(section: Any) -> type[StorageOptions]:
    """The model a raw section's type validates with (the base one when its type is not
    known): the loader names its fields when a key is unknown."""
    kind = section.get("type") if isinstance(section, Mapping) else None
    try:
        return find_backend(kind).options if isinstance(kind, str) else StorageOptions
    except ConfigError:
        return StorageOptions


def _options(section: StorageOptions | Mapping[str, Any]) -> StorageOptions:
    """A section as its type's model; a raw one that does not validate (a mapping given to
    ``fit()``, not read through the loader) is a one-line ConfigError naming the field."""
    if isinstance(section, StorageOptions):
        return section
    try:
        return parse_storage(section)  # type: ignore[no-any-return]
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(["checkpoint_storage", *map(str, first["loc"])])
        raise ConfigError(f"`{where}` is invalid: {first['msg']}") from None
    except ConfigError:
        raise
    except ValueError as err:  # the type is missing or not a name
        raise ConfigError(str(err)) from None


def local_folder(section: StorageOptions | Mapping[str, Any] | None) -> tuple[str, Path] | None:
    """(``checkpoint_storage.<fields>``, the resolved folder) a section writes checkpoints to
    on this machine; None for no section, a remote type or one not installed. A raw section
    is read as written, validated or not (a checkpoint's ``experiment_config`` may come from
    Determined)."""
    raw = section.model_dump() if isinstance(section, StorageOptions) else section
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if raw is None or not isinstance(kind, str):
        return None
    try:
        backend = find_backend(kind)
    except ConfigError:
        return None
    found = backend.folder(raw) if backend.folder is not None else None
    if found is None:
        return None
    fields, folder = found
    return f"checkpoint_storage.{fields}", folder.expanduser().resolve()


def store_from_config(exp_conf: Mapping[str, Any] | None) -> CheckpointStore:
    """The local store a config's ``checkpoint_storage`` names (its type's ``local_store``;
    ``./checkpoints`` without one). A type without a local store needs the platform's."""
    section = (exp_conf or {}).get("checkpoint_storage")
    if not section or (isinstance(section, Mapping) and section.get("type") is None):
        from det_tasks.checkpoints.store import LocalDirectoryStore

        return LocalDirectoryStore(DEFAULT_CHECKPOINT_DIR)
    options = _options(section)
    backend = find_backend(options.type)
    if backend.local_store is None:
        raise ConfigError(
            f"checkpoint_storage type {options.type!r} needs the registry's store: run "
            "through `det-tasks run` with the platform extra installed, or pass "
            "checkpoint_store= to init()"
        )
    return backend.local_store(options)
