"""User-facing errors: each says what is wrong, where, and how to fix it.

The CLI prints these as one paragraph without a traceback; anything else is a bug in
the harness and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "EXIT_INVALID_HP",
    "CheckpointError",
    "ConfigError",
    "DetTasksError",
    "InvalidHP",
    "StepFailed",
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


class StepFailed(Exception):
    """A trial's step raised: which trial, where (the user's function and the batch), the
    error and the user's frames, and whether retrying could help (a config or entrypoint
    error cannot be fixed by a retry; an exception in ``train_batch`` may be). Plain data,
    so it crosses processes (Dask) intact; its text is the one line a user reads."""

    def __init__(
        self,
        trial_id: int | str,
        phase: str,
        batch: int,
        error: str,
        location: str | None = None,
        retryable: bool = True,
        attempts: int = 1,
        user_traceback: str = "",
    ) -> None:
        self.trial_id, self.phase, self.batch, self.error = trial_id, phase, batch, error
        self.location, self.retryable, self.attempts = location, retryable, attempts
        self.user_traceback = user_traceback
        super().__init__(self._text())

    def _text(self) -> str:
        after = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        where = f" ({self.location})" if self.location else ""
        return (
            f"trial {self.trial_id} failed in {self.phase} at batch {self.batch}{after}: "
            f"{self.error}{where}"
        )

    def _arguments(self) -> dict[str, object]:
        """What ``__init__`` took, in its order: enough to rebuild this failure anywhere."""
        return {
            "trial_id": self.trial_id,
            "phase": self.phase,
            "batch": self.batch,
            "error": self.error,
            "location": self.location,
            "retryable": self.retryable,
            "attempts": self.attempts,
            "user_traceback": self.user_traceback,
        }

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (StepFailed, tuple(self._arguments().values()))

    def after_attempts(self, attempts: int) -> StepFailed:
        """The same failure, counted as the ``attempts``-th try."""
        return StepFailed(**{**self._arguments(), "attempts": attempts})  # type: ignore[arg-type]
