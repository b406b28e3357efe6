"""GPU leases on a worker host: exclusive across processes, released on exit or death."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from flows.devices import GpuLocks


def hold(lock_dir: str, n: int, started, release) -> None:
    with GpuLocks(4, lock_dir).lease(n) as indices:
        started.put(indices)
        release.wait(30)


def test_two_processes_never_share_a_gpu_and_a_dead_holder_frees_its_gpus(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Queue(), ctx.Event()
    other = ctx.Process(target=hold, args=(str(tmp_path), 3, started, release))
    other.start()
    taken = started.get(timeout=60)
    assert taken == [0, 1, 2]
    locks = GpuLocks(4, tmp_path)
    with locks.lease(1) as mine:
        assert mine == [3]
    with pytest.raises(TimeoutError), locks.lease(2, timeout_s=0.3, poll_s=0.1):
        pass
    other.kill()  # killed, not released: the kernel drops its locks
    other.join()
    started_at = time.monotonic()
    with locks.lease(4, timeout_s=10, poll_s=0.1) as everything:
        assert everything == [0, 1, 2, 3]
    assert time.monotonic() - started_at < 5


def test_more_gpus_than_the_host_has_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needs 3 GPUs .* has 2"), GpuLocks(2, tmp_path).lease(3):
        pass
