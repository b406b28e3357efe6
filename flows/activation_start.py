"""Which code an experiment's start runs, and what a failed activation puts back.

A start runs the package it was submitted as, else the experiment's code snapshot (taken
when it was created), and says when the folder on disk differs. An activation that fails
before any trial got past where it stopped changes nothing: its runs go back to PAUSED
with their checkpoints and code, and the error says whether the code changed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.flow_runs import suspend_flow_run
from prefect.runtime import deployment

from det_tasks.config import ExperimentConfig
from det_tasks.config.storage_paths import code_exclusions
from det_tasks.errors import DetTasksError, StepFailed
from det_tasks.runner.entrypoint_source import check_entrypoint_source
from registry.experiments.activation import (
    RunBefore,
    activation_progressed,
    back_to_paused,
    before_activation,
)
from registry.experiments.code import (
    ExperimentCode,
    adopt_code,
    code_for_start,
    code_verdict,
    package_code,
)
from registry.runs.tracking import ExperimentRuns

__all__ = ["PAUSED_FOR_S", "activation_settled", "code_for", "has_deployment", "reenter"]

# How long a deployment's paused flow run waits for `det experiment activate`.
PAUSED_FOR_S = 365 * 24 * 3600


def has_deployment() -> bool:
    """Whether this flow run belongs to a deployment (``det``, the stack), not a command."""
    return bool(deployment.get_id())


def code_for(
    client: Any,
    run_key: str,
    raw: dict[str, Any],
    cfg: ExperimentConfig,
    model_path: Path,
    package: str | None,
    use_changed_code: bool,
) -> tuple[Path, ExperimentCode]:
    """The code this start runs: the package it was submitted as, else the experiment's
    code snapshot (taken now for a new experiment); says when the folder differs from it.
    Its entrypoint is checked before any run exists, from its source (a retry cannot fix
    it; importing it here would load torch and the user's imports into the flow, ~2 s
    before the first trial starts: what only an import finds, the trial's worker reports
    as final). Returns the folder the trials import (the snapshot's, whatever
    ``model_path`` holds now) too."""
    if package:
        code = package_code(package, model_path)
    else:
        exclusions = code_exclusions(raw, model_path)
        code = code_for_start(client, run_key, model_path, exclusions, use_changed_code)
    if code.note:
        get_run_logger().warning(code.note)
    check_entrypoint_source(cfg, code.snapshot.folder)
    return code.snapshot.folder, code


def reenter(runs: ExperimentRuns, code: ExperimentCode) -> tuple[list[RunBefore], bool]:
    """Mark an activated experiment's runs RUNNING again (True if they had ended), keeping
    how they were (a failed activation puts that back), and record the code it runs."""
    before = before_activation(runs.client, runs.experiment_id, runs.parent_run_id)
    activated = runs.reopen(runs.parent_run_id)
    adopt_code(runs.client, runs.parent_run_id, code)
    return before, activated


@contextlib.contextmanager
def activation_settled(
    activated: bool,
    runs: ExperimentRuns,
    before: list[RunBefore],
    code: ExperimentCode,
    config_path: Path,
    run_key: str,
) -> Iterator[None]:
    """Training an activated experiment: a failure that comes before any trial got past
    where it stopped changes nothing (_failed_activation)."""
    try:
        yield
    except Exception as err:
        if activated:
            _failed_activation(err, runs, before, code, config_path, run_key)
        raise


def _failed_activation(
    err: Exception,
    runs: ExperimentRuns,
    before: list[RunBefore],
    code: ExperimentCode,
    config_path: Path,
    run_key: str,
) -> None:
    """An activation that failed before any trial got past where it stopped changes
    nothing: its runs go back to PAUSED with their checkpoints and code, the error says
    whether the code changed since the pause, and the same command activates it again (a
    deployment's run is suspended again, for ``det experiment activate``). Returns when
    the failure is the run's own (a trial trained on first): it ends ERROR as before."""
    try:
        if activation_progressed(runs.client, before):
            return
        verdict = code_verdict(code)
        back_to_paused(runs.client, before, f"{err}\n{verdict}")
    except Exception:  # MLflow unreachable: the failure stands as it is
        return
    short = run_key[:8]
    how = f"python -m flows.experiment {config_path} --activate {run_key}"
    if has_deployment():
        how = f"det experiment activate {short}"
    paused = f"experiment {short} stays PAUSED with its checkpoints; continue with: {how}"
    if has_deployment():
        get_run_logger().error("%s\n%s\n%s", err, verdict, paused)
        suspend_flow_run(timeout=PAUSED_FOR_S, key=uuid.uuid4().hex)
    if isinstance(err, StepFailed):
        lines = "\n".join([err.error, verdict, paused])
        raise StepFailed(
            err.trial_id,
            err.phase,
            err.batch,
            lines,
            err.location,
            err.retryable,
            err.attempts,
            err.user_traceback,
        ) from None
    raise DetTasksError(f"{err}\n{verdict}\n{paused}") from None
