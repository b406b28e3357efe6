"""An experiment runs its own code (issue 50, item 2), and a failed activate changes nothing
(issue 49, item 5), through ``python -m flows.experiment`` without servers, as a user runs
it: Ctrl-C pauses, the model folder is edited, and the printed ``--activate`` line runs.

- Found: a print added to ``train_batch`` after the pause ran in the resumed experiment,
  and nothing said the code had changed.
- Found: a layer widened in ``model_def.py``, then ``--activate``: "the checkpoint's model
  weights do not fit Sequential: Error(s) in loading state_dict for Sequential:; were
  hyperparameters that shape the model changed?", the experiment ERROR, and the next
  activate refused ("is ERROR, not paused")."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import helpers
from tests.integration.helpers import ctrl_c_midway, killable_runs, paused_at_the_stop_batch

SLOW_BATCHES = "hyperparameters.sleep_s=0.1"  # 12 s of training: time to stop it midway
WIDE = "nn.Linear(2, hidden + 2), nn.Tanh(), nn.Linear(hidden + 2, 1)"
NARROW = "nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1)"


def _model(home: Path) -> Path:
    """The user's copy of the flow tests' XOR example, to edit."""
    return Path(shutil.copytree(helpers.FLOW_MODEL, home / "model"))


def _experiment(home: Path, model: Path, *args: str) -> subprocess.Popen[str]:
    """The command, its stdout to ``home/stdout`` (read with its stderr by _output)."""
    config = str(model / "killable.yaml")
    with open(home / "stdout", "w") as stdout:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.experiment", config, SLOW_BATCHES, *args],
            cwd=home,
            env=helpers.home_env(home),
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )


def _output(home: Path, stderr: str) -> str:
    return stderr + (home / "stdout").read_text()


def _paused(home: Path, model: Path, pid_file: Path, *args: str) -> str:
    """Run (or activate) until the trial started, Ctrl-C; the output, checked paused."""
    pid_file.unlink(missing_ok=True)
    proc = _experiment(home, model, f"data.pid_file={pid_file}", *args)
    stderr, _ = ctrl_c_midway(proc, pid_file, after_s=4)
    output = _output(home, stderr)
    assert proc.returncode == 130, output[-3000:]
    time.sleep(1)
    assert helpers.group_alive(proc.pid) == []
    return output


def _ended(home: Path, model: Path, *args: str) -> tuple[int, str]:
    proc = _experiment(home, model, *args)
    _, stderr = proc.communicate(timeout=600)
    return proc.returncode, _output(home, stderr)


def _finished(home: Path, model: Path, *args: str) -> str:
    code, output = _ended(home, model, *args)
    assert code == 0, output[-4000:]
    return output


def _parent_tags(home: Path) -> dict[str, str]:
    runs = killable_runs(home)
    return next(r for r in runs if "mlflow.parentRunId" not in r.data.tags).data.tags


def test_activate_runs_the_snapshot_and_the_opt_in_runs_the_changed_code(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    model, pid_file, marker = _model(tmp_path), tmp_path / "pids", tmp_path / "new-code-ran"
    first = _paused(tmp_path, model, pid_file)
    key = re.search(r"--activate ([0-9a-f-]{36})", first)
    assert key, first[-2000:]
    created = _parent_tags(tmp_path)
    version = created["det.code_version"]
    assert (tmp_path / "det" / "code").is_dir(), "no snapshot in the home"

    # The folder moves on after the pause: the new code says so when it is imported.
    source = model / "model_def.py"
    source.write_text(
        source.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
    )
    resumed = _paused(tmp_path, model, pid_file, "--activate", key.group(1))
    line = [ln for ln in resumed.splitlines() if "differs from experiment" in ln]
    assert len(line) == 1, resumed[-4000:]
    assert "model_def.py changed" in line[0] and "--use-changed-code" in line[0]
    assert f"code snapshot {version}" in line[0]
    assert not marker.exists(), "the edited code ran without --use-changed-code"
    assert _parent_tags(tmp_path)["det.code_version"] == version
    paused_at_the_stop_batch(tmp_path)

    done = _finished(tmp_path, model, "--activate", key.group(1), "--use-changed-code")
    assert "resumes with the changed code" in done
    assert marker.exists(), "--use-changed-code did not run the folder's code"
    runs = killable_runs(tmp_path)
    assert {r.info.status for r in runs} == {"FINISHED"}
    for run in runs:  # the parent and the trial: a new code version, and the history
        tags = run.data.tags
        assert tags["det.code_version"] != version
        assert tags["det.code_versions"] == f"{version} {tags['det.code_version']}"


def test_a_failed_activate_leaves_the_experiment_paused(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    model, pid_file = _model(tmp_path), tmp_path / "pids"
    first = _paused(tmp_path, model, pid_file)
    key = re.search(r"--activate ([0-9a-f-]{36})", first)
    assert key, first[-2000:]
    _, trial, _ = paused_at_the_stop_batch(tmp_path)
    stopped_at = int(trial.data.metrics["progress/batches"])

    source = model / "model_def.py"
    narrow = source.read_text()
    assert NARROW in narrow
    source.write_text(narrow.replace(NARROW, WIDE))  # a layer widened: 6 -> 8
    code, failed = _ended(tmp_path, model, "--activate", key.group(1), "--use-changed-code")
    assert code == 1, failed[-4000:]
    assert (
        "size mismatch for 0.weight: copying a param with shape torch.Size([6, 2]) from "
        "checkpoint, the shape in current model is torch.Size([8, 2])." in failed
    ), failed[-4000:]
    assert "the shape in current model is torch.Size([1, 8])." in failed
    assert "the experiment's code changed since it was paused" in failed
    assert "model_def.py changed" in failed
    assert "were hyperparameters that shape the model changed" not in failed
    assert "stays PAUSED with its checkpoints; continue with: " in failed
    runs, trial_after, _ = paused_at_the_stop_batch(tmp_path)  # KILLED, PAUSED, same stop
    assert int(trial_after.data.metrics["progress/batches"]) == stopped_at
    assert all("det.error" not in r.data.tags for r in runs)
    assert "size mismatch" in _parent_tags(tmp_path)["det.activation_error"]
    assert len(set(_parent_tags(tmp_path)["det.code_versions"].split())) == 1

    source.write_text(narrow)  # the edit undone: the same line continues it
    done = _finished(tmp_path, model, "--activate", key.group(1))
    assert "differs from experiment" not in done
    runs = killable_runs(tmp_path)
    assert {r.info.status for r in runs} == {"FINISHED"}
    trial_done = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    assert int(trial_done.data.metrics["progress/batches"]) == 120
