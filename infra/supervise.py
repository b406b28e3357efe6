"""Keep one command running: ``python -m infra.supervise NAME -- COMMAND...`` starts it again
whenever it exits on its own, until it is asked to stop.

Why: a Dask worker (and its Nanny) closes for good when it loses its scheduler, so a
restarted scheduler, or a scheduler host brought back, met a cluster with no workers and
the experiment stopped for good. Under this supervisor the stack's and the hosts' workers
come back by themselves, and rejoin the scheduler once it answers. A worker's own crash
is still the Nanny's to handle (it restarts the worker process); this is the layer above.

The supervisor is the service's process-group leader (infra.services starts it so): a
stop (SIGTERM, SIGINT, SIGHUP) sent to the group reaches the command too, and the
supervisor then waits for it to exit and exits with it, restarting nothing; a stop sent to
the supervisor alone is passed on to the command after PASS_ON_AFTER_S. Restarts back
off from 1 s to 15 s while the command keeps failing quickly (its scheduler still away),
and start at 1 s again after a run of a minute or more.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["main", "supervise"]

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 15.0
HEALTHY_RUN_S = 60.0  # a run this long resets the back-off
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PASS_ON_AFTER_S = 10.0
KILL_AFTER_S = 20.0


class _Supervisor:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name, self.argv = name, argv
        self.stopping = False
        self.stop_signal: int = signal.SIGTERM
        self.stopped_at = 0.0
        self.child: subprocess.Popen[bytes] | None = None

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """A stop: restart nothing once the command exits (see ``_wait``)."""
        if not self.stopping:
            self.stopping, self.stop_signal = True, signum
            self.stopped_at = time.monotonic()

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        """The command's exit code. A stop sent to the group has reached the command too,
        and a second signal would cut its graceful close short (Dask's worker exits at
        once on a second SIGTERM); so the command is signalled only if it still runs
        PASS_ON_AFTER_S after the stop (the stop was sent to this process alone), and
        KILLed KILL_AFTER_S after it."""
        passed_on = False
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if not self.stopping:
                continue
            waited = time.monotonic() - self.stopped_at
            if waited >= KILL_AFTER_S:
                child.kill()
            elif waited >= PASS_ON_AFTER_S and not passed_on:
                passed_on = True
                child.send_signal(self.stop_signal)

    def run(self) -> int:
        delay = FIRST_DELAY_S
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.argv)
            code = self._wait(self.child)
            if self.stopping:
                return code
            ran = time.monotonic() - started
            delay = FIRST_DELAY_S if ran >= HEALTHY_RUN_S else delay
            _say(f"{self.name} exited with code {code} after {ran:.0f} s; starting it again in "
                 f"{delay:.0f} s")  # fmt: skip
            if _sleep_unless(lambda: self.stopping, delay):
                return code
            delay = min(delay * 2, MAX_DELAY_S)


def _sleep_unless(stopping: Callable[[], bool], seconds: float) -> bool:
    """Sleep ``seconds`` in short steps; True as soon as ``stopping()`` is."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stopping():
            return True
        time.sleep(0.1)
    return stopping()


def _say(line: str) -> None:
    print(f"supervise: {line}", file=sys.stderr, flush=True)


def supervise(name: str, argv: list[str]) -> int:
    """Run ``argv`` until stopped (see the module's docstring); its last exit code."""
    supervisor = _Supervisor(name, argv)
    for sig in STOP_SIGNALS:
        # A SIGHUP ignored at start (nohup) stays ignored: only the others stop it then.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, supervisor.on_signal)
    return supervisor.run()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m infra.supervise NAME -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    return supervise(args[0], args[2:])


if __name__ == "__main__":
    sys.exit(main())
