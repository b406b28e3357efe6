"""Library loggers that speak at INFO on every trial, set to WARNING wherever trials run.

Why: lines such as botocore's "Found credentials in environment variables" or MLflow's
"Started monitoring system metrics" repeat per run (96 of them in a 32-trial flow) and push
a real error out of view. Called by ``det-tasks`` and by each warm trial worker."""

from __future__ import annotations

import logging

__all__ = ["quiet_library_loggers"]

NOISY_LOGGERS = ("httpx", "botocore", "boto3", "mlflow.system_metrics")


def quiet_library_loggers() -> None:
    """Their warnings and errors still show."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
