"""A shard's spill (cluster.batch_shards._Spill): batches copied into one reused block and
flushed as row groups give back every record once, in order, with its own output, whatever
the batches' sizes against the block's."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from cluster.batch_shards import _Spill


def test_batches_across_flushes_come_back_once_in_order(tmp_path):
    spill = _Spill(tmp_path / "part.parquet", limit=4)
    sizes = [3, 3, 1, 4, 6, 2]  # crosses the block, fills it, exceeds it (6 > 4), a tail
    start = 0
    for n in sizes:
        ids = np.arange(start, start + n)
        outputs = np.stack([ids, 100 * (ids % 2)], axis=1).astype(np.float32)
        spill.add(ids, outputs)
        outputs[:] = 0  # the caller's buffer may be reused: the spill holds its own copy
        start += n
    spill.close()
    table = pq.read_table(tmp_path / "part.parquet").to_pydict()
    assert spill.rows == start == 19
    assert table["index"] == list(range(19))
    assert table["output"] == [[float(i), 100.0 * (i % 2)] for i in range(19)]
    assert table["argmax"] == [i % 2 for i in range(19)]
    meta = pq.ParquetFile(tmp_path / "part.parquet").metadata
    sizes_written = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sizes_written == [3, 4, 4, 6, 2]  # a flush whenever the next batch would not fit


def test_an_empty_shard_still_writes_its_object(tmp_path):
    spill = _Spill(tmp_path / "part.parquet")
    spill.close()
    assert pq.read_table(tmp_path / "part.parquet").num_rows == 0
