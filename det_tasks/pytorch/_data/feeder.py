"""Feeding batches to the device as fast as the step can take them.

Three sources, picked per loader: a one-index gather for ``TensorDataset`` loaders (no
per-sample ``__getitem__`` or collate), a torch DataLoader over our resumable batch
sampler, or a plain torch DataLoader when the user opted out of reproducibility checks.
On CUDA, a background thread pins each batch and copies it on a side stream while the
current step runs; on CPU the fetch stays in the main thread, which keeps RNG use in
datasets ordered and resumes exact.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils.data

from det_tasks.pytorch._data.loader import DataLoader, to_device

__all__ = ["iterate_batches", "DevicePrefetcher"]


def _gather_batches(loader: DataLoader, batch_sampler: Iterable[list[int]]) -> Iterator[Any]:
    tensors = loader.dataset.tensors  # type: ignore[attr-defined]
    for indices in batch_sampler:
        idx = torch.as_tensor(indices, dtype=torch.long)
        yield [t[idx] for t in tensors]


def iterate_batches(
    loader: DataLoader | torch.utils.data.DataLoader,
    *,
    seed: int,
    rank: int,
    size: int,
    repeat: bool,
    skip: int = 0,
    shuffle_draws: dict[int, Any] | None = None,
) -> Iterator[Any]:
    """Host-side batches of ``loader`` for this rank, optionally forever, after ``skip``.

    Starting an iteration draws what Determined's does from the global torch generator (or
    the loader's own): torch's DataLoader iterator takes one int64 for its workers' base
    seed when created. Our loaders use a private generator for that, so the draw is made
    here, keeping ``torch.rand`` inside train_batch/evaluate_batch equal to Determined's.
    """
    if isinstance(loader, DataLoader):
        if loader.supports_fast_gather() or loader.generator is None:
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        if loader.supports_fast_gather():
            sampler = loader.make_batch_sampler(seed, rank, size, repeat, skip, shuffle_draws)
            return _gather_batches(loader, sampler)
        torch_loader = loader.get_data_loader(
            seed, rank, size, repeat=repeat, skip=skip, shuffle_draws=shuffle_draws
        )
        return iter(torch_loader)
    return _replaying(loader, iter(loader), repeat, skip)


def _replaying(
    loader: torch.utils.data.DataLoader, first: Iterator[Any], repeat: bool, skip: int
) -> Iterator[Any]:
    """A plain torch DataLoader: resuming has to read and drop the skipped batches.
    ``first`` is the first epoch's iterator, created by the caller (now, as Determined)."""
    epoch: Iterator[Any] = first
    while True:
        for batch in epoch:
            if skip:
                skip -= 1
                continue
            yield batch
        if not repeat:
            return
        epoch = iter(loader)


class DevicePrefetcher:
    """Runs ``source`` in a thread, pinning and copying batches to ``device`` ahead of use."""

    _DONE = object()

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int = 4) -> None:
        self._source = source
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="det-tasks-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self._stream):
                for batch in self._source:
                    if self._stop.is_set():
                        return
                    pinned = _pin(batch)
                    on_device = to_device(pinned, self._device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._put((on_device, event))
            self._put(self._DONE)
        except BaseException as err:  # surfaced in the main thread
            self._put(err)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, event = item
        current = torch.cuda.current_stream(self._device)
        current.wait_event(event)
        _record_stream(batch, current)
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch if batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)({k: _pin(v) for k, v in batch.items()})
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        return type(batch)(_pin(v) for v in batch)
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, list | tuple):
        for v in batch:
            _record_stream(v, stream)
