"""Parquet files on S3 (``s3://bucket/prefix/*.parquet``) as batch inference's input, streamed
by shard.

Planning reads only the files' footers: the row groups, their row counts and the schema, so
a missing column is refused before any shard starts. Each shard then reads only its own row
groups, a batch at a time (``iter_batches``): its memory stays flat as the dataset grows.
Record ids are the ``id_column``'s values, or the row's position in the whole dataset.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from det_tasks.errors import ConfigError
from registry.servers import s3 as s3_lib

__all__ = ["ParquetSpec", "RowGroup", "iter_batches", "plan", "shard_row_groups"]


@dataclasses.dataclass(frozen=True)
class ParquetSpec:
    uri: str
    columns: tuple[str, ...]
    id_column: str | None = None

    @classmethod
    def parse(cls, uri: str, columns: Any, id_column: str | None = None) -> ParquetSpec:
        if not uri.startswith("s3://") or not uri.endswith(".parquet"):
            raise ConfigError(
                f"dataset {uri!r}: a Parquet dataset is `s3://bucket/prefix/*.parquet` (a glob "
                "or one file ending in .parquet)"
            )
        if isinstance(columns, str):
            columns = [columns]
        if not columns or not all(isinstance(c, str) and c for c in columns):
            raise ConfigError(
                f"dataset {uri!r} needs `columns`: the input columns to read, e.g. "
                "columns: [pixels] (numeric or fixed-length list columns)"
            )
        return cls(uri, tuple(columns), id_column)


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One unit of reading: a row group of one file, and its rows' global positions."""

    key: str
    index: int
    first_row: int
    num_rows: int


def _filesystem() -> pafs.S3FileSystem:
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    options: dict[str, Any] = {
        "access_key": os.environ.get("AWS_ACCESS_KEY_ID"),
        "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
        "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        options.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    return pafs.S3FileSystem(**{k: v for k, v in options.items() if v is not None})


def _keys(spec: ParquetSpec) -> tuple[str, list[str]]:
    location = s3_lib.parse_s3_uri(spec.uri)
    pattern = location.prefix
    static = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    directory = static.rsplit("/", 1)[0] if "/" in static else ""
    listed = s3_lib.list_keys(s3_lib.client(), s3_lib.S3Location(location.bucket, directory))
    keys = sorted(k for k in listed if fnmatch.fnmatchcase(k, pattern))
    if not keys:
        raise ConfigError(
            f"dataset {spec.uri!r} matches no object in bucket {location.bucket!r}; check the "
            "prefix and the glob (e.g. s3://bucket/inputs/*.parquet)"
        )
    return location.bucket, keys


def plan(spec: ParquetSpec) -> list[RowGroup]:
    """Every row group of every matching file, in order; checks the columns exist."""
    bucket, keys = _keys(spec)
    fs = _filesystem()
    groups: list[RowGroup] = []
    row = 0
    wanted = [*spec.columns, *([spec.id_column] if spec.id_column else [])]
    for key in keys:
        with fs.open_input_file(f"{bucket}/{key}") as f:
            meta = pq.ParquetFile(f).metadata
        names = set(meta.schema.names)
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ConfigError(
                f"dataset {spec.uri!r}: s3://{bucket}/{key} has no column(s) {missing}; its "
                f"columns are {sorted(names)}: fix `columns`/`id_column` in the config"
            )
        for i in range(meta.num_row_groups):
            n = meta.row_group(i).num_rows
            groups.append(RowGroup(f"{bucket}/{key}", i, row, n))
            row += n
    return groups


def shard_row_groups(groups: list[RowGroup], shard: int, num_shards: int) -> list[RowGroup]:
    """Contiguous, disjoint, covering: the row groups whose first row falls in this shard's
    share of the rows (row groups are never split, so a shard reads whole ones)."""
    total = sum(g.num_rows for g in groups)
    lo, hi = shard * total // num_shards, (shard + 1) * total // num_shards
    return [g for g in groups if lo <= g.first_row < hi]


def _as_features(table: pa.RecordBatch, columns: tuple[str, ...]) -> np.ndarray:
    parts = []
    for name in columns:
        column = table.column(name)
        if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
            width = len(column[0]) if len(column) else 0
            values = column.flatten().to_numpy(zero_copy_only=False)
            parts.append(values.reshape(len(column), width))
        else:
            parts.append(column.to_numpy(zero_copy_only=False).reshape(len(column), 1))
    return np.concatenate(parts, axis=1).astype(np.float32, copy=False)


def iter_batches(
    spec: ParquetSpec, groups: list[RowGroup], batch_size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(record ids, float32 features [batch, width]) for the rows of ``groups``, a batch at
    a time; the features are the ``columns`` side by side (list columns flattened)."""
    fs = _filesystem()
    read = [*spec.columns, *([spec.id_column] if spec.id_column else [])]
    for group in groups:
        with fs.open_input_file(group.key) as f:
            reader = pq.ParquetFile(f)
            row = group.first_row
            for batch in reader.iter_batches(
                batch_size=batch_size, row_groups=[group.index], columns=read
            ):
                n = batch.num_rows
                if spec.id_column:
                    ids = batch.column(spec.id_column).to_numpy(zero_copy_only=False)
                else:
                    ids = np.arange(row, row + n, dtype=np.int64)
                row += n
                yield ids, _as_features(batch, spec.columns)
