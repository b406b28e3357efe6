"""Prefect tasks for one trial: train a segment (train -> validate -> checkpoint) in a worker
process of its own, and find where a trial left off.

Each segment runs ``det-tasks run`` in a subprocess: trials never share a global RNG (exact
resume), a trial can be killed without killing the flow, and a retry resumes from the
trial's latest checkpoint recorded in MLflow (never from a pickled model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from flows.devices import gpu_lease
from registry.checkpoints import checkpoint_records
from registry.settings import RegistrySettings
from registry.tracking import PARENT_TAG, TRIAL_TAG, client_for

__all__ = ["TrialFailed", "resume_candidates", "train_segment"]


class TrialFailed(RuntimeError):
    """A trial's process exited with an error; the message carries its last output (the
    traceback that matters is the trial's, not the orchestrator's)."""


def resume_candidates(parent_run_id: str, experiment_id: str, trial_id: int) -> list[str]:
    """The URIs of the trial's checkpoints, newest first (the runner resumes from the first
    intact one); empty if it has none yet."""
    settings = RegistrySettings.from_env()
    assert settings.tracking_uri
    client = client_for(settings.tracking_uri)
    runs = client.search_runs(
        [experiment_id],
        filter_string=(
            f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{PARENT_TAG}` = '{parent_run_id}'"
        ),
        max_results=1,
    )
    if not runs:
        return []
    records = checkpoint_records(client, runs[0].info.run_id)
    return [r["uri"] for r in reversed(records)]


@task(name="train-segment", retry_delay_seconds=1, log_prints=True)
def train_segment(
    config: str,
    model_dir: str,
    overrides: list[str],
    trial_id: int,
    hparams: dict[str, Any],
    batches: int | None,
    run_key: str,
    parent_run_id: str,
    experiment_id: str,
    device: str | None = None,
    slots: int = 1,
) -> dict[str, Any]:
    """Train trial ``trial_id`` up to ``batches`` (resuming from its latest checkpoint),
    validate and checkpoint; returns the runner's summary."""
    logger = get_run_logger()
    resume = resume_candidates(parent_run_id, experiment_id, trial_id)
    with tempfile.TemporaryDirectory() as tmp:
        summary_file = Path(tmp) / "summary.json"
        cmd = [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            config,
            model_dir,
            "--no-progress",
            "--trial-id",
            str(trial_id),
            "--experiment-run",
            run_key,
            "--hparams",
            json.dumps(hparams),
            "--summary-file",
            str(summary_file),
        ]
        if batches is not None:
            cmd += ["--max-batches", str(batches)]
        for uri in resume:
            cmd += ["--resume", uri]
        if resume:
            logger.info("trial %s resumes from %s", trial_id, resume[0])
        if device:
            cmd += ["--device", device]
        for item in overrides:
            cmd += ["--param", item]
        with gpu_lease(slots) as gpu_env:
            if gpu_env:
                logger.info("trial %s on GPUs %s", trial_id, gpu_env["CUDA_VISIBLE_DEVICES"])
            env = {**os.environ, **gpu_env, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
            )
            tail: list[str] = []
            assert proc.stderr is not None
            for line in proc.stderr:
                line = line.rstrip()
                tail = [*tail, line][-20:]
                if line.startswith(("validation @", "checkpoint @", "error:")):
                    logger.info("trial %s: %s", trial_id, line)
            code = proc.wait()
        if code != 0:
            raise TrialFailed(
                f"trial {trial_id} failed (exit code {code}); last output:\n" + "\n".join(tail)
            )
        return dict(json.loads(summary_file.read_text()))
