"""Issue 52 item 6 on the real stack: a Hugging Face ``Trainer`` with ``DetCallback`` (a
2-layer GPT-2 built from a config in code, synthetic tokens; nothing downloaded) under
``det-tasks run``. Stopped mid-training (SIGTERM, as a pause or preemption reaches it), it
stores a checkpoint in S3 and stops; resumed from ``latest_checkpoint`` it ends with
weights bit-equal to an uninterrupted run's, and its metrics in MLflow are the same."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from det_tasks.checkpoints.references import open_checkpoint_uri
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import client_for
from tests.integration.helpers import home_env

pytest.importorskip("transformers", reason="the transformers extra is not installed")

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "hf_trainer" / "const.yaml"
SLOW = ["-p", "hyperparameters.step_seconds=0.3"]  # the stop lands mid-training


def _det_tasks_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "det_tasks.runner.cli", "run", *args, "--no-progress"]


def _summary(stdout: str) -> dict:
    """The runner's JSON summary (the Trainer prints its logs to stdout before it)."""
    return json.loads(stdout[stdout.index('{\n  "batches_trained"') :])


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "checkpoint-12" / "model.safetensors"))


def _run_id(stderr: str) -> str:
    found = re.search(r"MLflow run: \S*runs/([0-9a-f]{32})", stderr)
    assert found, stderr[-3000:]
    return found.group(1)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_det_callback_stops_and_resumes_to_the_uninterrupted_weights(stack, tmp_path):
    whole_out, whole_err = tmp_path / "whole.out", tmp_path / "whole.err"
    with whole_out.open("w") as out, whole_err.open("w") as err:
        whole = subprocess.Popen(  # the uninterrupted run, beside the stopped one
            _det_tasks_run(str(CONFIG), "--checkpoint-dir", str(tmp_path / "whole")),
            cwd=tmp_path,
            env=home_env(tmp_path),
            stdout=out,
            stderr=err,
        )
    stopped = subprocess.Popen(
        _det_tasks_run(str(CONFIG), *SLOW),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    run_id = _first_checkpoint(client, stopped)
    stopped.send_signal(signal.SIGTERM)
    _, stderr = stopped.communicate(timeout=120)
    assert stopped.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    found = re.search(
        r"stopped by SIGTERM at batch (\d+), checkpoint (\S+); continue with: (.*)", stderr
    )
    assert found, stderr[-3000:]
    batch = int(found.group(1))
    assert 4 <= batch < 12, batch  # mid-training, at the step the stop arrived
    records = checkpoint_records(client, run_id)
    assert records[-1]["steps_completed"] == batch and records[-1]["s3_uri"].startswith("s3://")
    assert found.group(2) == records[-1]["uri"]

    argv = shlex.split(found.group(3))
    resumed = subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert whole.wait(timeout=300) == 0, whole_err.read_text()[-3000:]
    whole_summary = _summary(whole_out.read_text())
    expected = _weights(Path(whole_summary["checkpoint"]))
    assert "latest checkpoint downloaded to" in resumed.stderr
    final = _summary(resumed.stdout)["checkpoint"]
    with open_checkpoint_uri(final) as path:
        weights = _weights(path)
    assert sorted(weights) == sorted(expected)
    assert all(weights[name].equal(expected[name]) for name in expected)  # bit-equal

    resumed_id = _run_id(resumed.stderr)
    losses = _history(client, resumed_id, "training/loss")
    assert [step for step, _ in losses][-(12 - batch) :] == list(range(batch + 1, 13))
    evals = dict(_history(client, resumed_id, "validation/eval_loss"))
    assert evals[12] == whole_summary["validation"]["eval_loss"]


def _first_checkpoint(client, proc: subprocess.Popen) -> str:
    """The trial's MLflow run id once it has recorded its first checkpoint."""
    run_id = None
    deadline = time.monotonic() + 240
    lines: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        if run_id is None:
            line = proc.stderr.readline()
            lines.append(line)
            found = re.search(r"runs/([0-9a-f]{32})", line)
            run_id = found.group(1) if found else None
            continue
        if checkpoint_records(client, run_id):
            return run_id
        time.sleep(0.2)
    raise AssertionError("no checkpoint recorded: " + "".join(lines)[-3000:])
