"""GPU slots for trial segments: which GPUs of this worker host a segment may use.

Two layers, so two trials never share a GPU by accident:

- a Prefect global concurrency limit ``gpu-slots-<host>`` (limit = the host's GPU count,
  created on first use) caps the GPU slots all flow runs on this host hold, and shows the
  occupancy in the Prefect UI;
- per-GPU lock files (``fcntl.flock``) pick *which* GPUs: a segment holds the locks of the
  indices it was given for as long as it runs, and the kernel drops them if it dies.

The segment's process then sees only its GPUs (``CUDA_VISIBLE_DEVICES``). On a host
without GPUs nothing is leased and trials train on the CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["GpuLocks", "gpu_count", "gpu_lease"]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class GpuLocks:
    """Exclusive, crash-safe leases on GPU indices 0..count-1 of this host."""

    def __init__(self, count: int, lock_dir: str | Path | None = None) -> None:
        self.count = count
        self.lock_dir = Path(lock_dir or Path(tempfile.gettempdir()) / "det-tasks-gpu-locks")
        self.lock_dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lease(self, n: int, timeout_s: float = 3600.0, poll_s: float = 1.0) -> Iterator[list[int]]:
        """Wait until ``n`` GPUs are free; yields their indices, held until the block ends."""
        if n > self.count:
            raise ValueError(
                f"a trial needs {n} GPUs (resources.slots_per_trial) but this worker host has "
                f"{self.count}; lower slots_per_trial or use a host with more GPUs"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            held = self._try(n)
            if held is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {n} free GPUs on this host within {timeout_s:.0f}s")
            time.sleep(poll_s)
        try:
            yield [index for index, _ in held]
        finally:
            for _, handle in held:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()

    def _try(self, n: int) -> list[tuple[int, IO[bytes]]] | None:
        held: list[tuple[int, IO[bytes]]] = []
        for index in range(self.count):
            handle: IO[bytes] = open(self.lock_dir / f"gpu-{index}.lock", "ab")  # noqa: SIM115
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            held.append((index, handle))
            if len(held) == n:
                return held
        for _, handle in held:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        return None


@contextlib.contextmanager
def gpu_lease(n: int) -> Iterator[dict[str, str]]:
    """Environment for a segment needing ``n`` GPUs (empty on a CPU-only host)."""
    count = gpu_count()
    if count == 0:
        yield {}
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    name = f"gpu-slots-{socket.gethostname()}"
    # Suppressed: the limit exists already (or another segment created it just now).
    with get_client(sync_client=True) as client, contextlib.suppress(Exception):
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=count))
    with concurrency(name, occupy=n, strict=True), GpuLocks(count).lease(n) as indices:
        yield {"CUDA_VISIBLE_DEVICES": ",".join(map(str, indices))}


if __name__ == "__main__":  # `python -m flows.devices`: what this host offers
    print(f"{gpu_count()} GPUs; lock dir {GpuLocks(0).lock_dir}; pid {os.getpid()}")
