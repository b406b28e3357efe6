"""Batch inference's input as shards: any torch Dataset, streamed, with record ids.

A ``module:function`` from the checkpoint's code (or the job package) builds the dataset:
a map-style ``Dataset`` (shard i of k reads only indices ``[i*n//k, (i+1)*n//k)``), an
``IterableDataset`` (shard i keeps records ``i, i+k, i+2k, ...`` of the stream, or asks the
dataset itself through ``shard(i, k)`` when it has one, so it reads only its records), or, as
before, a tensor or ``(inputs, labels)`` tensors. Batches go one at a time, so a shard's
memory does not grow with the dataset.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from det_tasks.errors import ConfigError

__all__ = ["as_dataset", "load_dataset", "model_input", "shard_batches", "shard_range"]


def shard_range(n: int, shard: int, num_shards: int) -> range:
    """Contiguous, disjoint, covering: shard i of k gets records [i*n//k, (i+1)*n//k)."""
    return range(shard * n // num_shards, (shard + 1) * n // num_shards)


def load_dataset(spec: str, code_dir: Path | None) -> torch.utils.data.Dataset:
    """Call ``module:function`` (imported from ``code_dir`` first) and check what it built."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function or " " in spec:
        raise ConfigError(
            f"dataset {spec!r} is neither `module:function` (code in the checkpoint or job "
            "package that returns a torch Dataset) nor `s3://bucket/prefix/*.parquet`"
        )
    if code_dir is not None:
        sys.path.insert(0, str(code_dir))
    try:
        sys.modules.pop(module_name, None)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name.split(".")[0]:
                raise
            raise ConfigError(
                f"dataset {spec!r}: no module {module_name!r} in the checkpoint's code "
                f"({code_dir}); ship it in the model directory"
            ) from None
        if not callable(getattr(module, function, None)):
            raise ConfigError(f"dataset {spec!r}: {module_name} has no function {function!r}")
        built = getattr(module, function)()
    finally:
        if code_dir is not None and str(code_dir) in sys.path:
            sys.path.remove(str(code_dir))
    return as_dataset(built, spec)


def as_dataset(built: Any, spec: str = "dataset") -> torch.utils.data.Dataset:
    """A Dataset as is; a tensor, or (inputs, labels) tensors, as a TensorDataset."""
    if isinstance(built, torch.utils.data.Dataset):
        return built
    if isinstance(built, list | tuple) and built and isinstance(built[0], torch.Tensor):
        built = built[0]
    if isinstance(built, torch.Tensor):
        return torch.utils.data.TensorDataset(built)
    raise ConfigError(
        f"dataset {spec!r} returned {type(built).__name__}; return a torch Dataset (map-style "
        "or IterableDataset), a tensor, or (inputs, labels) tensors"
    )


def model_input(batch: Any) -> Any:
    """What the model takes: the first element of an ``(inputs, labels, ...)`` batch."""
    if isinstance(batch, list | tuple) and batch:
        return batch[0]
    return batch


def shard_batches(
    dataset: torch.utils.data.Dataset, shard: int, num_shards: int, batch_size: int
) -> Iterator[tuple[np.ndarray, Any]]:
    """(record ids, collated batch) for shard ``shard`` of ``num_shards``, a batch at a time."""
    collate = torch.utils.data.default_collate
    if isinstance(dataset, torch.utils.data.IterableDataset):
        sharder = getattr(dataset, "shard", None)
        if callable(sharder):  # the dataset reads only its records (ids it yields as pairs)
            pairs: Iterator[tuple[int, Any]] = iter(sharder(shard, num_shards))
        else:
            pairs = itertools.islice(enumerate(dataset), shard, None, num_shards)
        while chunk := list(itertools.islice(pairs, batch_size)):
            ids = np.fromiter((i for i, _ in chunk), dtype=np.int64, count=len(chunk))
            yield ids, collate([item for _, item in chunk])
        return
    rows = shard_range(len(dataset), shard, num_shards)  # type: ignore[arg-type]
    if isinstance(dataset, torch.utils.data.TensorDataset):  # one index op per batch
        for start in range(rows.start, rows.stop, batch_size):
            stop = min(start + batch_size, rows.stop)
            yield np.arange(start, stop), [t[start:stop] for t in dataset.tensors]
        return
    # The range as the sampler: the loader indexes the dataset itself (its __getitems__
    # when it has one), as a plain loop's does, not through a Subset's extra call a record.
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=rows)
    for start, batch in zip(range(rows.start, rows.stop, batch_size), loader, strict=True):
        yield np.arange(start, min(start + batch_size, rows.stop)), batch
