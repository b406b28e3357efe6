"""det_tasks: a Determined-compatible PyTorchTrial harness with no platform imports.

The harness trains a trial on CPU, one GPU or several workers, and reports through two
small interfaces (a metrics sink and a checkpoint store) so that ``registry/`` can plug
MLflow and S3 in without this package importing either: what it provides (run services,
checkpoint URI resolvers, ``det-tasks`` subcommands) is found through entry points
(``det_tasks.plugins``).
"""

from det_tasks.errors import CheckpointError, ConfigError, DetTasksError, TrialError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "DetTasksError", "TrialError", "__version__"]
