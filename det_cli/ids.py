"""Short printable ids. An experiment is keyed by the UUID of the Prefect flow run that created
it; ``det`` shows its first 8 hex characters (like git's short SHAs) and accepts any unique
prefix of 8+ characters or the whole UUID. A trial is ``EXPERIMENT/N`` (its number in that
experiment) or its MLflow run id. There are no integer ids: handing them out would need a
central counter the platform does not have."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from det_tasks.errors import DetTasksError

__all__ = ["TrialRef", "experiment_run", "parse_trial_ref", "short_id"]

SHORT_LENGTH = 8
MLFLOW_RUN_ID = re.compile(r"[0-9a-f]{32}")


def short_id(flow_run_id: Any) -> str:
    """The first 8 hex characters of a flow-run UUID: what ``det`` prints."""
    return str(flow_run_id)[:SHORT_LENGTH]


def experiment_run(ident: str) -> Any:
    """The experiment flow run named by ``ident`` (unique prefix of 8+ characters or UUID)."""
    from det_cli.submission import find_flow_run

    return find_flow_run(ident.strip().lower())


@dataclasses.dataclass(frozen=True)
class TrialRef:
    """A trial as the user named it: ``EXPERIMENT/N``, or an MLflow run id."""

    experiment: str | None
    number: str | None
    mlflow_run_id: str | None


def parse_trial_ref(text: str) -> TrialRef:
    text = text.strip().lower()
    if MLFLOW_RUN_ID.fullmatch(text):
        return TrialRef(None, None, text)
    experiment, sep, number = text.partition("/")
    if sep and number.isdigit() and len(experiment) >= SHORT_LENGTH:
        return TrialRef(experiment, number, None)
    raise DetTasksError(
        f"trial id {text!r} is neither EXPERIMENT/N (e.g. 1a2b3c4d/1, as `det experiment "
        "list-trials` shows) nor an MLflow run id (32 hex characters)"
    )
