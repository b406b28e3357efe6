"""User-facing errors: each says what is wrong, where, and how to fix it.

The CLI prints these as one paragraph without a traceback; anything else is a bug in
the harness and keeps its traceback.
"""

__all__ = [
    "EXIT_INVALID_HP",
    "CheckpointError",
    "ConfigError",
    "DetTasksError",
    "InvalidHP",
    "TrialError",
    "TrialStopped",
]

# `det-tasks run`'s exit code when the trial rejected its hyperparameters (det.InvalidHP):
# not a failure to retry, but a trial for the searcher to drop (and replace).
EXIT_INVALID_HP = 3


class DetTasksError(Exception):
    """A mistake in the user's config, trial code or files, explained for the user."""


class ConfigError(DetTasksError, ValueError):
    """The experiment configuration is malformed or inconsistent."""


class TrialError(DetTasksError):
    """The user's trial class broke the PyTorchTrial contract."""


class CheckpointError(DetTasksError):
    """A checkpoint is missing, truncated, corrupted or from an unknown format."""


class InvalidHP(Exception):
    """``det.InvalidHP``: raised by a trial to reject its hyperparameters; the searcher
    drops the trial (random and adaptive_asha propose a replacement)."""


class TrialStopped(Exception):
    """A trial was stopped on request (pause, cancel, kill, Ctrl-C), not by a fault: its run
    ends KILLED with ``state`` (Determined's word: PAUSED or CANCELED) as the reason."""

    def __init__(self, state: str, why: str = "") -> None:
        super().__init__(f"trial stopped: {state}" + (f" ({why})" if why else ""))
        self.state = state
