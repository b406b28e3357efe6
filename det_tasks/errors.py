"""User-facing errors: each says what is wrong, where, and how to fix it.

The CLI prints these as one paragraph without a traceback; anything else is a bug in
the harness and keeps its traceback.
"""

__all__ = ["CheckpointError", "ConfigError", "DetTasksError", "TrialError"]


class DetTasksError(Exception):
    """A mistake in the user's config, trial code or files, explained for the user."""


class ConfigError(DetTasksError, ValueError):
    """The experiment configuration is malformed or inconsistent."""


class TrialError(DetTasksError):
    """The user's trial class broke the PyTorchTrial contract."""


class CheckpointError(DetTasksError):
    """A checkpoint is missing, truncated, corrupted or from an unknown format."""
