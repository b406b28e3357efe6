"""``reuse_freed_memory``: in a process started as Dask's nanny starts its workers
(``MALLOC_TRIM_THRESHOLD_=65536``), a loop that frees and reallocates 1 MiB buffers page-faults
every buffer in again outside the block and almost never inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.worker_heap import _glibc, reuse_freed_memory

CHILD = """
import json, resource
import numpy as np
from cluster.worker_heap import reuse_freed_memory

def faults_of_100_buffers():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        np.ones(2**17)  # 1 MiB, allocated and freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults_of_100_buffers()
with reuse_freed_memory() as raised:
    faults_of_100_buffers()  # the first buffer faults in once
    inside = faults_of_100_buffers()
after = faults_of_100_buffers()
print(json.dumps({"raised": raised, "outside": outside, "inside": inside, "after": after}))
"""

pytestmark = pytest.mark.skipif(_glibc() is None, reason="mallopt is glibc's")


def test_freed_buffers_are_reused_inside_the_block_only():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    pages = 2**20 // 4096
    assert got["raised"] is True
    assert got["outside"] >= 90 * pages  # every buffer mapped and faulted in afresh
    assert got["inside"] < 5 * pages  # the freed buffer reused
    assert got["after"] >= 90 * pages  # the environment's thresholds are back


def test_no_threshold_in_the_environment_changes_nothing(monkeypatch):
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    with reuse_freed_memory() as raised:
        assert raised is False
