"""The environment a batch-inference job's process is given by its launcher (the flow's job
task, or ``det job run``): which job it is and where its outputs go. Public, because the
launchers (flows, registry) set what the harness reads."""

from __future__ import annotations

__all__ = ["JOB_ID_ENV", "JOB_OUTPUT_ENV"]

JOB_ID_ENV = "DET_TASKS_JOB_ID"
JOB_OUTPUT_ENV = "DET_TASKS_JOB_OUTPUT"
