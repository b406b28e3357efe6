"""The one place this project uses a private name of MLflow: its metric-name check. The
sink needs MLflow's own verdict before a batch is sent (the server refuses a whole batch
for one bad name), and MLflow has no public function for it. If MLflow renames or changes
it, ``tests/unit/test_mlflow_internals.py`` fails, naming this module."""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric_name

__all__ = ["metric_name_problem"]


def metric_name_problem(name: str) -> str | None:
    """Why MLflow would refuse ``name`` as a metric name, or None if it takes it."""
    try:
        _validate_metric_name(name)
    except MlflowException as err:
        return str(err.message)
    return None
