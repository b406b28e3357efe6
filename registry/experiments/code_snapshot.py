"""An experiment's code snapshot: the model definition taken when the experiment is created,
which every later start of it runs (``--activate``, ``det experiment activate``, a
preempted or retried trial), as Determined runs an experiment with the model definition it
was created with, whatever the folder on disk holds by then.

The snapshot is a model package (det_tasks.checkpoints.model_package: only code, the bytes
addressed by their sha256): in S3 (``s3://BUCKET/packages/<sha256>.tar.gz``) when a bucket
is configured, else in the det_tasks home (``$DET_TASKS_HOME/code/<sha256>.tar.gz``). It
is unpacked once per host into ``$DET_TASKS_HOME/code/<sha256>/``, the folder the trials
import from. The experiment's MLflow parent run names it (``det.code_package``) with its
code version (``det.code_version``, the trial runs' hash of the same files), and the
versions it ran, oldest first (``det.code_versions``): resuming with changed code, on the
user's explicit request, adds one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from det_tasks.checkpoints.code_selection import model_files
from det_tasks.checkpoints.model_package import pack_model_dir, unpack_model_package
from det_tasks.errors import DetTasksError
from det_tasks.home import det_tasks_home
from registry.experiments.packages import download_package, upload_package
from registry.servers.settings import RegistrySettings

__all__ = [
    "CODE_HISTORY_TAG",
    "CODE_VERSION_TAG",
    "SNAPSHOT_TAG",
    "CodeSnapshot",
    "changed_files",
    "code_version",
    "describe_changes",
    "open_snapshot",
    "record_snapshot",
    "snapshot_tags",
    "take_snapshot",
]

SNAPSHOT_TAG = "det.code_package"
CODE_VERSION_TAG = "det.code_version"
CODE_HISTORY_TAG = "det.code_versions"
_SUFFIX = ".tar.gz"


@dataclasses.dataclass(frozen=True)
class CodeSnapshot:
    """A snapshot: where it is kept (``uri``), its unpacked folder on this host, and its
    code version."""

    uri: str
    folder: Path
    version: str
    # This host's copy of the package: what the snapshot holds, whatever a trial wrote into
    # its folder since (None for a package the flow was given, never compared).
    archive: Path | None


def _store() -> Path:
    folder = det_tasks_home() / "code"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def take_snapshot(model_dir: Path, excluded_dirs: Sequence[Path] = ()) -> CodeSnapshot:
    """Snapshot ``model_dir``'s model definition (minus the config's checkpoint folders,
    ``excluded_dirs``): to S3 when ``DET_TASKS_S3_BUCKET`` is set, else into the home."""
    packed = pack_model_dir(model_dir, excluded_dirs=excluded_dirs)
    settings = RegistrySettings.from_env()
    store = _store()
    archive = store / f"{packed.sha256}{_SUFFIX}"
    if settings.bucket:
        uri, _ = upload_package(packed, settings)
    else:
        uri = str(archive)
    if not archive.exists():  # this host's copy, also where a local snapshot lives
        _write_atomically(archive, packed.data)
    return _opened(uri, archive)


def open_snapshot(uri: str) -> CodeSnapshot:
    """The snapshot ``uri`` names (a tag's value), unpacked on this host (downloaded from
    S3 the first time a host needs it)."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    archive = _store() / name
    if not archive.exists() and uri.startswith("s3://"):
        download_package(uri, archive)
    elif not archive.exists():
        archive = Path(uri)  # kept in another det_tasks home
    if not archive.is_file() and not (_store() / name.removesuffix(_SUFFIX)).is_dir():
        raise DetTasksError(
            f"the experiment's code snapshot {uri} is gone, so it cannot resume with the "
            "code it was created with; add --use-changed-code to resume with the model "
            "folder as it is now"
        )
    return _opened(uri, archive)


def _opened(uri: str, archive: Path) -> CodeSnapshot:
    folder = _store() / archive.name.removesuffix(_SUFFIX)
    if not folder.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=_store()))
        try:
            _place(unpack_model_package(archive, staging / "model"), folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return CodeSnapshot(uri, folder, _version(_archived(archive)), archive)


def _archived(archive: Path) -> dict[str, bytes]:
    """Every file the package holds, by name."""
    with tarfile.open(archive, mode="r:gz") as tar:
        return {
            m.name: f.read()
            for m in tar.getmembers()
            if m.isfile() and (f := tar.extractfile(m)) is not None
        }


def _version(files: dict[str, bytes]) -> str:
    """The code version of these files: registry.jobs.trial_services.code_version's hash (names
    and bytes, sorted), so the parent run and the trial runs agree."""
    digest = hashlib.sha256()
    for name in sorted(files, key=lambda n: n.split("/")):  # as Paths sort
        digest.update(name.encode())
        digest.update(files[name])
    return digest.hexdigest()[:12]


def _place(unpacked: Path, folder: Path) -> None:
    """Move an unpacked snapshot to ``folder``; another process that did first wins (the
    content is the same)."""
    try:
        os.rename(unpacked, folder)
    except OSError:
        if not folder.is_dir():
            raise


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def changed_files(
    snapshot: CodeSnapshot, model_dir: Path, excluded_dirs: Sequence[Path] = ()
) -> list[str]:
    """How ``model_dir``'s model definition differs from the snapshot, file by file:
    ``NAME changed``, ``NAME added`` or ``NAME removed``, sorted by name."""
    on_disk = dict(model_files(model_dir, excluded_dirs=excluded_dirs))
    kept = _archived(snapshot.archive) if snapshot.archive else {}
    differences = []
    for rel in sorted(set(on_disk) | set(kept)):
        if rel not in kept:
            differences.append(f"{rel} added")
        elif rel not in on_disk:
            differences.append(f"{rel} removed")
        elif _read(on_disk[rel]) != kept[rel]:
            differences.append(f"{rel} changed")
    return differences


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # vanished since it was listed
        return None


def describe_changes(differences: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` differences, and how many more."""
    text = ", ".join(differences[:shown])
    more = len(differences) - shown
    return f"{text} (and {more} more)" if more > 0 else text


def snapshot_tags(run: Any) -> dict[str, str]:
    """The snapshot tags a run carries now (to put back if an activation fails)."""
    tags = run.data.tags
    names = (SNAPSHOT_TAG, CODE_VERSION_TAG, CODE_HISTORY_TAG)
    return {name: tags[name] for name in names if name in tags}


def record_snapshot(client: Any, run_ids: Sequence[str], snapshot: CodeSnapshot) -> None:
    """Record ``snapshot`` as the code the runs ``run_ids`` run from now on: the package,
    its version, and the version appended to the history when it is new."""
    for run_id in run_ids:
        tags = client.get_run(run_id).data.tags
        # A trial run is created with its det.code_version only (trial_run_tags).
        history = tags.get(CODE_HISTORY_TAG, tags.get(CODE_VERSION_TAG, "")).split()
        if not history or history[-1] != snapshot.version:
            history.append(snapshot.version)
        client.set_tag(run_id, SNAPSHOT_TAG, snapshot.uri)
        client.set_tag(run_id, CODE_VERSION_TAG, snapshot.version)
        client.set_tag(run_id, CODE_HISTORY_TAG, " ".join(history))


def code_version(model_dir: Path) -> str:
    """A short hash of the model directory's files (what code produced a run)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        digest.update(path.relative_to(model_dir).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
