"""What a signal that killed a process most likely means, in the words a user acts on.

One wording for every process of a trial that can die by a signal: its Dask worker
(``cluster.worker_deaths``) and its DataLoader worker processes (``det_tasks.loader_failures``).
"""

from __future__ import annotations

import contextlib
import signal

__all__ = ["signal_cause"]

_CAUSES = {
    signal.SIGKILL: (
        "out of memory? (the kernel's OOM killer sends it; see `dmesg`), or killed by hand"
    ),
    signal.SIGBUS: (
        "out of shared memory? (DataLoader workers pass batches through /dev/shm: `df -h "
        "/dev/shm`; raise its size, e.g. `docker run --shm-size=8g` or a Kubernetes emptyDir "
        "with medium: Memory, or lower num_workers / prefetch_factor)"
    ),
    signal.SIGSEGV: "a crash in native code",
}


def signal_cause(number: int) -> str:
    """``killed by signal N (NAME): likely cause`` for a process ended by signal ``number``."""
    with contextlib.suppress(ValueError):
        sig = signal.Signals(number)
        cause = _CAUSES.get(sig)
        return f"killed by signal {number} ({sig.name})" + (f": {cause}" if cause else "")
    return f"killed by signal {number}"
