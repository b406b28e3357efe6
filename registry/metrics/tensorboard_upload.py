"""A run's TensorBoard and profiler files (what a trial wrote into its TensorBoard folder)
uploaded as the run's ``tensorboard/`` artifacts, without ever failing the trial.

Why: these files are auxiliary; the work is the checkpoints and the metrics. An upload that
failed during an S3 fault once failed a whole train task, before its first checkpoint, and
the error (boto3's, holding the open file) could not even be pickled back to the flow. So
an upload is tried a few times; if it still fails, the files are dropped with one warning
that says what was lost and why, and nothing is raised.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["ATTEMPTS", "upload_tensorboard"]

_logger = logging.getLogger(__name__)
ATTEMPTS = 3  # an S3 or MLflow hiccup usually passes within seconds
_PAUSE_S = 1.0  # before the 2nd try; doubled before each later one


def upload_tensorboard(client: Any, run_id: str, folder: Path, pause_s: float = _PAUSE_S) -> bool:
    """Upload ``folder``'s files (if any) as run ``run_id``'s ``tensorboard/`` artifacts,
    then remove the folder. True when uploaded (or nothing to upload); False when every
    attempt failed and the files were dropped with one warning."""
    try:
        if not any(p.is_file() for p in folder.rglob("*")):
            return True
        error = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(pause_s * 2 ** (attempt - 1))
            try:
                client.log_artifacts(run_id, str(folder), artifact_path="tensorboard")
                return True
            except Exception as err:  # never the trial's failure: see the module's note
                error = f"{type(err).__name__}: {err}"  # text only: the error may hold files
        _logger.warning(
            "the TensorBoard files of run %s were not uploaded after %d attempts (%s); "
            "they are dropped, training is not affected",
            run_id,
            ATTEMPTS,
            error,
        )
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)
