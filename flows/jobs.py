"""A batch job's script (``entrypoint_script`` in a ``det-tasks job run`` config) as a Prefect
task: run in its own process inside the unpacked model package, with the config (and its
``data:`` section, ``context.config_data``) handed over as Determined's cluster info, and
whatever it writes to ``$DET_TASKS_OUTPUT_DIR`` uploaded to S3 afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from det_tasks import cluster_info
from det_tasks.pytorch.harness import JOB_ID_ENV, JOB_OUTPUT_ENV
from det_tasks.runner import worker_group as launcher
from det_tasks.runner.determined_launch_layers import parse_launch_layer
from det_tasks.runner.entrypoint import parse_script_command
from registry.servers import s3 as s3_lib
from registry.servers.settings import RegistrySettings

__all__ = ["OUTPUT_DIR_ENV", "run_job_script"]

OUTPUT_DIR_ENV = "DET_TASKS_OUTPUT_DIR"


@task(name="run-job-script", log_prints=True)
def run_job_script(
    model_dir: str, script: str, config: dict[str, Any], job_id: str, output: str
) -> dict[str, Any]:
    """Run ``script`` to completion; returns the S3 URIs of the files it wrote."""
    logger = get_run_logger()
    path, args = parse_script_command(script)
    layer = parse_launch_layer(script)
    slots = int((config.get("resources") or {}).get("slots_per_trial", 1))
    info = cluster_info.ClusterInfo(
        trial=cluster_info.TrialInfo(
            trial_id=job_id, experiment_id=job_id, hparams={}, config=config, trial_seed=0
        ),
        latest_checkpoint=None,
        checkpoint_dir=str(Path(model_dir) / "checkpoints"),
        model_dir=model_dir,
    )
    with tempfile.TemporaryDirectory(prefix="det-tasks-job-") as scratch:
        info_file = Path(scratch) / "cluster_info.json"
        info_file.write_text(info.to_json(), encoding="utf-8")
        out_dir = Path(scratch) / "output"
        out_dir.mkdir()
        env = {
            **os.environ,
            cluster_info.ENV_VAR: str(info_file),
            OUTPUT_DIR_ENV: str(out_dir),
            JOB_ID_ENV: job_id,
            JOB_OUTPUT_ENV: output,
        }
        argv = [sys.executable, "-m", "det_tasks.runner.script", str(path), *args]
        if slots > 1 or layer.backend is not None:  # one process per slot, Determined's way
            backend = launcher.resolve_backend(
                layer.backend
                or str((config.get("resources") or {}).get("distributed_backend", "auto"))
            )
            env = {**launcher.worker_env(slots, backend), **env}
            argv = launcher.launch_command(slots, backend, argv[1:], layer.overrides)
        logger.info("running %s in %s (%d slot(s))", script, model_dir, slots)
        proc = subprocess.run(argv, cwd=model_dir, env=env, capture_output=True, text=True)
        for line in (proc.stdout + proc.stderr).splitlines()[-200:]:
            logger.info("%s", line)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-3000:]
            raise RuntimeError(f"job script {script!r} exited with {proc.returncode}:\n{tail}")
        files = sorted(p for p in out_dir.rglob("*") if p.is_file())
        location = s3_lib.parse_location(output)
        if files:
            s3_lib.upload_dir(
                s3_lib.client(RegistrySettings.from_env().s3_endpoint), out_dir, location
            )
    return {
        "output": output,
        "files": [f"{location.uri}/{p.relative_to(out_dir).as_posix()}" for p in files],
    }
