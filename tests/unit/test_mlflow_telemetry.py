"""MLflow's usage telemetry is off in the platform's processes, as the stack's Prefect
analytics are, unless the user says otherwise: MLflow reads MLFLOW_DISABLE_TELEMETRY, or
DO_NOT_TRACK only when it is "true" (flows sets it to "1", Prefect's spelling)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# What MLflow takes for a CI or a test run, where it sends nothing anyway.
CI_SIGNS = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL")


def telemetry_disabled(imports: str, **env: str) -> bool:
    """MLflow's own verdict in a fresh process that imports ``imports`` first, as a user's
    process outside CI (no CI variables, no opt-outs) plus ``env``."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in CI_SIGNS and k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")
    }
    code = f"{imports}\nfrom mlflow.telemetry.utils import is_telemetry_disabled\n"
    code += "print(is_telemetry_disabled())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1] == "True"


def test_mlflow_alone_would_send_telemetry_even_with_prefects_opt_out() -> None:
    assert not telemetry_disabled("import mlflow")  # what the check must be able to see
    assert not telemetry_disabled("import mlflow", DO_NOT_TRACK="1")


@pytest.mark.parametrize("entry", ["registry", "registry.runs.tracking"])
def test_the_platforms_processes_send_none(entry: str) -> None:
    assert telemetry_disabled(f"import {entry}")


def test_a_user_who_wants_it_keeps_it() -> None:
    assert not telemetry_disabled("import registry", MLFLOW_DISABLE_TELEMETRY="false")
