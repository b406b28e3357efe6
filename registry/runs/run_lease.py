"""Which process writes a trial run now: a fencing token on the run, so a process that was
cut off and came back cannot count anything twice.

Whoever opens a trial's services (a worker building or restoring the trial, ``det-tasks
run``) stamps the run's ``det.holder`` tag with a token of its own; the newest opener is
the one the scheduler gave the trial to. Before each write that a later holder would
repeat (a metric batch, a checkpoint record, ending the run), a writer checks that the tag
still names it. A worker cut off from the cluster trains on in the dark; when its link
returns, its first check sees the other holder, and it stops writing for good ("fenced").

The check and the write are two requests (MLflow has no compare-and-set): a holder taking
over between them lets at most that one write through, which is why the check comes last,
right before the write.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid as uuid_lib
from typing import Any

__all__ = ["HOLDER_TAG", "RunLease"]

log = logging.getLogger(__name__)
HOLDER_TAG = "det.holder"


class RunLease:
    """This process's claim on one trial run."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.token = f"{socket.gethostname()} pid {os.getpid()} {uuid_lib.uuid4().hex[:8]}"
        self.lost_to: str | None = None  # the holder that took the run over; never undone
        # The newest batch this process recorded a checkpoint at (-1: none): a holder
        # taking over resumes from it at the latest, and reports everything after it again.
        self.recorded_through = -1

    def recorded(self, steps_completed: int) -> None:
        """A checkpoint at ``steps_completed`` was recorded by this process."""
        self.recorded_through = max(self.recorded_through, steps_completed)

    def take(self) -> None:
        """Claim the run: every earlier holder is fenced from now on."""
        self.client.set_tag(self.run_id, HOLDER_TAG, self.token)

    def held(self) -> bool:
        """Whether the run still names this process (asked of MLflow each time, so that a
        process back from a network partition sees the truth before its first write).
        Raises what the MLflow client raises when it cannot ask; the caller retries."""
        if self.lost_to is not None:
            return False
        holder = self.client.get_run(self.run_id).data.tags.get(HOLDER_TAG)
        if holder is not None and holder != self.token:
            self.lost_to = holder
            log.warning(
                "trial run %s is now written by %r, not this process (%s): it was given to "
                "another worker while this one was cut off; what this one still holds is "
                "dropped",
                self.run_id,
                holder,
                self.token,
            )
        return self.lost_to is None
