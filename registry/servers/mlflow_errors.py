"""MLflow's refusals, told apart from the network's without importing MLflow: the REST
readers' error (registry.runs.mlflow_rest) and MLflow's own client's."""

from __future__ import annotations

import sys

from det_tasks.errors import DetTasksError

__all__ = ["MlflowReaderError", "refused_by_mlflow"]


class MlflowReaderError(DetTasksError):
    """The MLflow server answered with an error (``error_code``: MLflow's, e.g.
    RESOURCE_DOES_NOT_EXIST), or could not be reached (``error_code`` None)."""

    def __init__(self, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


def refused_by_mlflow(err: BaseException) -> bool:
    """Whether the MLflow server answered with ``err`` (MLflow's client's MlflowException,
    or MlflowReaderError with MLflow's error code), not the network; imports no MLflow."""
    if isinstance(err, MlflowReaderError):
        return err.error_code is not None
    exceptions = sys.modules.get("mlflow.exceptions")
    return exceptions is not None and isinstance(err, exceptions.MlflowException)
