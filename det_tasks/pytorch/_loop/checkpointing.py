"""Writing a checkpoint without holding training up longer than a host copy of its state.

The training thread builds the state dict, runs ``on_checkpoint_save_start``, and copies
every tensor to host memory (pinned and reused between checkpoints on CUDA, with one sync);
a background thread then serialises ``state_dict.pth``, writes ``load_data.json`` and
``code/``, and publishes (checksums, ``metadata.json`` last, upload). A failure there
publishes nothing and surfaces on the training thread at the next boundary.

A trial whose callbacks implement ``on_checkpoint_write_end`` (or the older
``on_checkpoint_end``) is written synchronously instead, as Determined does: those callbacks
run on the training thread with the files in place and the model still at the checkpoint's
weights, and files they add become part of the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.disk_full import (
    UNKNOWN_FOLDER,
    CheckpointSpaceFull,
    no_space,
    os_error_in,
    os_error_text,
)
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.config.storage_paths import code_exclusions
from det_tasks.errors import CheckpointError

__all__ = ["CheckpointWriter", "CheckpointFiles", "snapshot"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """What goes into a checkpoint directory besides the state."""

    load_data: dict[str, Any]
    model_dir: Path | None
    metadata: dict[str, Any]  # steps_completed, validation metrics, versions, time

    @property
    def steps(self) -> int:
        return int(self.metadata["steps_completed"])


@dataclasses.dataclass
class _Job:
    uuid: str
    staged: Path
    files: CheckpointFiles
    thread: threading.Thread | None = None
    error: BaseException | None = None


class CheckpointWriter:
    """Stages, writes and publishes one trial's checkpoints, one at a time."""

    def __init__(self, store: CheckpointStore, device: torch.device) -> None:
        self.store = store
        self.device = device
        self._job: _Job | None = None
        self._finished: list[tuple[str, dict[str, Any]]] = []
        self._last_published: str | None = None
        self._pinned: dict[int, list[torch.UntypedStorage]] = {}  # reused host buffers

    def save(
        self,
        state: dict[str, Any],
        files: CheckpointFiles,
        write_end: list[Callable[[str], None]],
        previous: str | None,
    ) -> str:
        """Write a checkpoint; returns its uuid at once unless ``write_end`` callbacks
        need the files (then after publishing). ``previous`` is named if this one fails."""
        self._wait_for_job()  # one snapshot in memory at a time
        self._last_published = self._last_published or previous
        staged = self.store.stage()
        job = _Job(staged.name, staged, files)
        if write_end:
            self._write_and_publish(job, state, write_end)
            self._raise_if_failed(job)
            return job.uuid
        try:
            host_state = snapshot(state, self._pinned)
        except BaseException:
            self.store.discard(staged)
            raise
        job.thread = threading.Thread(
            target=self._write_and_publish,
            args=(job, host_state, []),
            name=f"det-tasks-checkpoint-{files.steps}",
            daemon=True,  # killed with the process: metadata.json is never written, so
        )  # nothing half-written is ever published
        self._job = job
        job.thread.start()
        return job.uuid

    def finished(self, wait: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """(uuid, metadata) of checkpoints published since the last call; raises the
        CheckpointError of one that failed. ``wait`` waits for the one being written."""
        job = self._job
        if job is not None and job.thread is not None and (wait or not job.thread.is_alive()):
            self._wait_for_job()
        done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        """Wait for the checkpoint being written (training ended or raised)."""
        try:
            self._wait_for_job()
        except BaseException as err:  # training's own error, if any, is the one to raise
            log.error("the last checkpoint was not published: %s", err)

    def _wait_for_job(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        assert job.thread is not None
        job.thread.join()
        self._raise_if_failed(job)

    def _raise_if_failed(self, job: _Job) -> None:
        if job.error is not None:
            raise job.error
        self._finished.append((job.uuid, job.files.metadata))
        self._last_published = job.uuid

    def _write_and_publish(
        self, job: _Job, state: dict[str, Any], write_end: list[Callable[[str], None]]
    ) -> None:
        try:
            write_files(job.staged, state, job.files)
            for callback in write_end:
                callback(str(job.staged))
            uuid = self.store.publish(job.staged, job.files.metadata)
            if uuid != job.uuid:
                raise CheckpointError(
                    f"{type(self.store).__name__}.publish returned {uuid!r} for the staged "
                    f"directory {job.staged.name!r}: a CheckpointStore must publish a "
                    "checkpoint under its staged directory's name"
                )
        except BaseException as err:
            self.store.discard(job.staged)
            job.error = self._explain(err, job)

    def _explain(self, err: BaseException, job: _Job) -> BaseException:
        os_error = os_error_in(err)
        if os_error is None:
            return err
        full = no_space(err)
        if full is not None:  # one wording wherever a checkpoint meets a full disk
            folder = full.folder if full.folder != UNKNOWN_FOLDER else str(job.staged.parent)
            return CheckpointSpaceFull(folder, job.files.steps, self._last_published, full.why)
        previous = self._last_published or "none"
        return CheckpointError(
            f"writing the checkpoint at batch {job.files.steps} into {job.staged} failed: "
            f"{os_error_text(os_error)}; nothing was published and the previous "
            f"checkpoint ({previous}) is intact. Free space or point checkpoint_storage "
            "elsewhere"
        )


def write_files(staged: Path, state: dict[str, Any], files: CheckpointFiles) -> None:
    """``state_dict.pth``, ``load_data.json`` and ``code/`` into ``staged``."""
    # Through a Python file, so a full disk surfaces as OSError(ENOSPC) in the chain
    # rather than only as torch's "unexpected pos" from its zip writer.
    with open(staged / ckpt.STATE_FILE, "wb") as state_file:
        torch.save(state, state_file)
    ckpt.write_json(staged / ckpt.LOAD_DATA_FILE, files.load_data)
    if files.model_dir is not None:
        # The config's checkpoint folders inside the model directory are left out wherever
        # this checkpoint is staged (an MLflow/S3 store stages in its cache).
        config = files.load_data.get("experiment_config")
        excluded = code_exclusions(config if isinstance(config, dict) else None, files.model_dir)
        ckpt.copy_code(files.model_dir, staged, excluded)


def snapshot(state: Any, pinned: dict[int, list[torch.UntypedStorage]] | None = None) -> Any:
    """A copy of ``state`` that training can no longer change, on the host.

    Tensors are copied storage by storage (views and tied weights keep sharing, so the
    saved file is byte-identical to saving ``state`` itself, CUDA tensors aside, which
    become CPU tensors); CUDA storages go to pinned buffers from ``pinned`` (reused across
    checkpoints, since the state's shapes rarely change) with one sync at the end.
    Everything else is deep-copied.
    """
    copier = _Copier(pinned if pinned is not None else {})
    out = copier.copy(state)
    for device in copier.cuda_devices:
        torch.cuda.synchronize(device)
    copier.release_unused()
    return out


class _Copier:
    def __init__(self, pinned: dict[int, list[torch.UntypedStorage]]) -> None:
        self.memo: dict[tuple[int, str, int], torch.UntypedStorage] = {}
        self.containers: dict[int, Any] = {}
        self.deep_memo: dict[int, Any] = {}
        self.pinned = pinned
        self.available = {size: list(bufs) for size, bufs in pinned.items()}
        self.cuda_devices: set[torch.device] = set()

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if not isinstance(obj, dict | list | tuple):
            return copy.deepcopy(obj, self.deep_memo)
        if id(obj) in self.containers:  # shared twice in the state: shared in the copy
            return self.containers[id(obj)]
        out: Any
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type (OrderedDict, Counter, ...)
            for key, value in obj.items():
                out[key] = self.copy(value)
            if getattr(obj, "__dict__", None):  # e.g. state_dict()'s _metadata
                out.__dict__.update(copy.deepcopy(obj.__dict__, self.deep_memo))
        elif isinstance(obj, list):
            out = [self.copy(v) for v in obj]
        else:
            items = [self.copy(v) for v in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        self.containers[id(obj)] = out
        return out

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            return t.detach().to("cpu", copy=True)
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(storage.device), storage.nbytes())
        host = self.memo.get(key)
        if host is None:
            host = self.memo[key] = self.storage(storage)
        out = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out

    def storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        if storage.device.type != "cuda":
            return storage.clone()
        self.cuda_devices.add(storage.device)
        size = storage.nbytes()
        reusable = self.available.get(size)
        if reusable:
            host = reusable.pop()
        else:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True).untyped_storage()
            self.pinned.setdefault(size, []).append(host)
        host.copy_(storage, non_blocking=True)
        return host

    def release_unused(self) -> None:
        """Pinned buffers no storage of this state needed are freed (the state changed)."""
        for size, unused in self.available.items():
            for buffer in unused:
                self.pinned[size] = [b for b in self.pinned[size] if b is not buffer]
        for size in [s for s, bufs in self.pinned.items() if not bufs]:
            del self.pinned[size]
