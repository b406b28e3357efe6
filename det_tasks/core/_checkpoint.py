"""``core.CheckpointContext``: a Core API script's checkpoints go through the trial's
checkpoint store, as a ``PyTorchTrial``'s do: sealed with checksums (``metadata.json``,
holding the script's metadata, written last), uploaded to S3 and recorded on the trial's
MLflow run on the platform, a folder per storage id locally."""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from det_tasks import __version__
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.references import open_checkpoint_uri, scheme_of
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.distributed import DistributedContext
from det_tasks.run_services import TrialControl
from det_tasks.sinks import MetricsSink

__all__ = ["CheckpointContext", "DownloadMode"]

log = logging.getLogger("determined.core")

# What seal() adds to metadata.json besides the script's metadata.
_SEAL_KEYS = ("files", "signature", "format_version")
Selector = Callable[[str], bool]


class DownloadMode(enum.Enum):
    """``LocalWorkersShareDownload``: the workers of a node call ``restore_path``/``download``
    in step and its local chief fetches the checkpoint once for all of them;
    ``NoSharedDownload``: each caller fetches on its own."""

    LocalWorkersShareDownload = "LOCAL_WORKERS_SHARE_DOWNLOAD"
    NoSharedDownload = "NO_SHARED_DOWNLOAD"


class CheckpointContext:
    """Store, restore, download and delete one trial's checkpoints by storage id."""

    def __init__(
        self,
        store: CheckpointStore,
        sink: MetricsSink,
        dist: DistributedContext,
        control: TrialControl,
        describe: Callable[[int], dict[str, Any]],
        steps_required: bool,
    ) -> None:
        self._store = store
        self._sink = sink
        self._dist = dist
        self._control = control
        self._describe = describe  # what the platform adds to metadata at a step
        self._steps_required = steps_required

    @contextlib.contextmanager
    def store_path(
        self, metadata: dict[str, Any] | None = None, *, shard: bool = False
    ) -> Iterator[tuple[Path, str]]:
        """A fresh folder to save the checkpoint into and its storage id; on leaving the
        block it is sealed and stored (and on the platform uploaded and recorded). With
        ``shard=True`` every worker calls it in step, each writes its own files into its own
        folder, and they become one checkpoint (two workers writing one file is an error)."""
        if shard:
            with self._store_shards(metadata) as (path, storage_id):
                yield path, storage_id
            return
        self._chief_only("store_path", shard)
        sealed = self._metadata(metadata)
        staged = self._store.stage()
        try:
            yield staged, staged.name
        except BaseException:
            self._store.discard(staged)
            raise
        self._publish(staged, sealed)

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str],
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Selector | None = None,
    ) -> str:
        """Store the files of ``ckpt_dir`` (those ``selector`` keeps, by relative path) as a
        new checkpoint; returns its storage id (``shard=True``: every worker uploads its
        part, as with ``store_path``)."""
        source = Path(ckpt_dir)
        if not source.is_dir():
            raise NotADirectoryError(f"upload: ckpt_dir {str(source)!r} is not a directory")
        if shard:
            with self.store_path(metadata, shard=True) as (path, storage_id):
                _copy_tree(source, path, selector)
            return storage_id
        self._chief_only("upload", shard)
        sealed = self._metadata(metadata)
        staged = self._store.stage()
        try:
            _copy_tree(source, staged, selector)
        except BaseException:
            self._store.discard(staged)
            raise
        return self._publish(staged, sealed)

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Selector | None = None,
    ) -> Iterator[Path]:
        """A local folder holding the checkpoint (checked against its checksums) for the
        block. ``storage_id`` may also be a URI or path, as ``latest_checkpoint`` can be.
        With ``LocalWorkersShareDownload`` (the default) every worker calls it in step and
        the node's local chief fetches it for all. ``selector`` is accepted; the whole
        checkpoint is made available."""
        if not self._shared(download_mode):
            with self._open(storage_id) as path:
                yield path
            return
        with contextlib.ExitStack() as stack:
            mine = stack.enter_context(self._open(storage_id)) if self._fetches else None
            path = Path(self._dist.broadcast_local(str(mine) if mine else None))
            try:
                yield path
            finally:
                self._dist.gather_local(None)  # the local chief keeps it until all are done

    def download(
        self,
        storage_id: str,
        ckpt_dir: str | os.PathLike[str],
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Selector | None = None,
    ) -> None:
        """Copy the checkpoint's files (those ``selector`` keeps) into ``ckpt_dir`` (with
        ``LocalWorkersShareDownload``, once per node, by its local chief)."""
        shared = self._shared(download_mode)
        if not shared or self._fetches:
            with self._open(storage_id) as path:
                _copy_tree(path, Path(ckpt_dir), selector)
        if shared:
            self._dist.broadcast_local(None)  # the others wait for the copy

    def _shared(self, download_mode: DownloadMode) -> bool:
        mode = DownloadMode(download_mode)
        return mode == DownloadMode.LocalWorkersShareDownload and self._dist.size > 1

    @property
    def _fetches(self) -> bool:
        return self._dist.local_rank == 0

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        """The metadata the checkpoint was stored with."""
        with self._open(storage_id) as path:
            data = ckpt.read_json(path / ckpt.METADATA_FILE)
        return {k: v for k, v in data.items() if k not in _SEAL_KEYS}

    def delete(self, storage_id: str, globs: list[str] | None = None) -> None:
        """Remove a checkpoint of this trial, with its record."""
        if globs is not None:
            raise NotImplementedError(
                "checkpoint.delete(globs=...) (deleting part of a checkpoint) is not supported "
                "by det_tasks: delete the whole checkpoint, or store a smaller one"
            )
        if scheme_of(storage_id) is not None or os.sep in storage_id:
            raise ValueError(
                f"checkpoint.delete takes a storage id of this trial, got {storage_id!r}"
            )
        self._store.delete(storage_id)

    def close(self) -> None:
        """Wait for uploads still running (raising a failed one's error)."""
        self._store.completed_uploads(wait=True)

    # ---- helpers -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _store_shards(self, metadata: dict[str, Any] | None) -> Iterator[tuple[Path, str]]:
        """Each worker writes into a folder of its own (the chief into the staged one);
        the chief then gathers the others' files (same node) and metadata, and stores."""
        dist = self._dist
        if dist.cross_size > 1:
            raise NotImplementedError(
                "checkpoint.store_path(shard=True) across several nodes is not supported by "
                "det_tasks: gather the state on one node's workers, or store from the chief"
            )
        staged = self._store.stage() if dist.rank == 0 else None
        storage_id = dist.broadcast(staged.name if staged is not None else None)
        own = staged if staged is not None else Path(tempfile.mkdtemp(prefix="det-tasks-shard-"))
        try:
            yield own, storage_id
            parts = dist.allgather((str(own), metadata or {}))
            if staged is not None:
                merged = _merged_shards(staged, parts)
                self._publish(staged, self._metadata(merged))
        except BaseException:
            if staged is not None:
                self._store.discard(staged)
            raise
        finally:
            dist.broadcast(None)  # the chief has copied every part: each may go
            if staged is None:
                shutil.rmtree(own, ignore_errors=True)

    def _chief_only(self, what: str, shard: bool) -> None:
        if self._dist.rank != 0:
            raise RuntimeError(
                f"cannot call CheckpointContext.{what}() from non-chief worker "
                f"(rank={self._dist.rank})"
            )

    def _metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        if not isinstance(metadata, dict | None):
            raise TypeError(f"checkpoint metadata must be a dict, got {metadata!r}")
        given = dict(metadata or {})
        if "steps_completed" not in given:
            if self._steps_required:
                raise ValueError(
                    "checkpoint metadata needs 'steps_completed' (the batches trained), e.g. "
                    "store_path({'steps_completed': steps_completed})"
                )
            given["steps_completed"] = self._control.steps_completed
        steps = given["steps_completed"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"checkpoint metadata 'steps_completed' must be an int >= 0: {steps!r}"
            )
        platform = {"det_tasks_version": __version__, "time": time.time()}
        return {**platform, **self._describe(steps), **given}

    def _publish(self, staged: Path, metadata: dict[str, Any]) -> str:
        self._store.completed_uploads(wait=False)  # an earlier upload's failure, first
        uuid = self._store.publish(staged, metadata)
        steps = int(metadata["steps_completed"])
        self._sink.report_checkpoint(steps, uuid, metadata)
        self._control.reached(steps)
        log.info("stored checkpoint %s at batch %d", uuid, steps)
        return uuid

    @contextlib.contextmanager
    def _open(self, reference: str) -> Iterator[Path]:
        if not isinstance(reference, str) or not reference:
            raise ValueError(f"a checkpoint storage id must be a non-empty str, got {reference!r}")
        with contextlib.ExitStack() as stack:
            if os.path.isdir(reference):
                path = Path(reference)
            elif scheme_of(reference) is not None:
                path = stack.enter_context(open_checkpoint_uri(reference))
            else:
                path = stack.enter_context(self._store.restore(reference))
            ckpt.verify(path)
            yield path


def _merged_shards(staged: Path, parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Copy every other worker's files into ``staged`` and merge all workers' metadata; a
    file or metadata key two workers wrote differently is an error naming both ranks."""
    owner = {p.relative_to(staged).as_posix(): 0 for p in staged.rglob("*") if p.is_file()}
    merged: dict[str, Any] = {}
    given_by: dict[str, int] = {}
    for rank, (folder, metadata) in enumerate(parts):
        for key, value in metadata.items():
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"checkpoint shards disagree on metadata {key!r}: rank {given_by[key]} "
                    f"gave {merged[key]!r}, rank {rank} {value!r}"
                )
            merged[key], given_by[key] = value, given_by.get(key, rank)
        if rank == 0:
            continue
        source = Path(folder)
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = file.relative_to(source).as_posix()
            if rel in owner:
                raise ValueError(
                    f"checkpoint shards of ranks {owner[rel]} and {rank} both wrote {rel!r}: "
                    "give each worker's files names of their own"
                )
            owner[rel] = rank
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, staged / rel)
    return merged


def _copy_tree(source: Path, dest: Path, selector: Selector | None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = file.relative_to(source).as_posix()
        if selector is not None and not selector(rel):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target)
