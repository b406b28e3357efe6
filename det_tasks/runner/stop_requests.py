"""A stop request from whoever started ``det-tasks run`` (a flow's worker: a pause, cancel
or preemption of the experiment), passed to a Core API script's ``should_preempt()``.

The starter names a file in ``DET_TASKS_STOP_FILE`` and writes the state the trial should
end in (``PAUSED``, ``CANCELED``, ``PREEMPTED``) into it when the stop is asked. Once the
script has stopped, ``raise_if_requested`` ends the trial's run in that state, and
``det-tasks run`` reports where it stopped (exit 0, ``stopped`` in its summary). A file,
not a signal: a script that never entered ``core.init()`` is not disturbed (its segment
runs on, or is stopped after the grace period, as before)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from det_tasks.errors import TrialStopped
from det_tasks.run_services import TrialControl

__all__ = ["STOP_FILE_ENV", "RequestedStop", "passed_to", "raise_if_requested"]

STOP_FILE_ENV = "DET_TASKS_STOP_FILE"
POLL_S = 0.2


class RequestedStop(TrialStopped):
    """The script stopped on its starter's request at ``batches``, with the checkpoint
    ``reference`` (None: none was stored)."""

    def __init__(self, state: str, batches: int, reference: str | None) -> None:
        super().__init__(state, f"at batch {batches}")
        self.batches, self.reference = batches, reference


@contextlib.contextmanager
def passed_to(control: TrialControl) -> Iterator[None]:
    """While the block runs, a request written to the stop file sets ``control``'s stop."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            if os.path.exists(path):
                control.request_stop()
                return

    watcher = threading.Thread(target=watch, name="det-tasks-stop-file", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def raise_if_requested(control: TrialControl, batches: int, reference: str | None) -> None:
    """After the script returned: RequestedStop if it stopped on a request of the file."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path or not control.stop.is_set() or not os.path.exists(path):
        return
    state = Path(path).read_text(encoding="utf-8").strip() or "PAUSED"
    raise RequestedStop(state, batches, reference)
