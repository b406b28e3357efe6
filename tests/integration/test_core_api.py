"""Issue 52 (first slice): Core API scripts (``entrypoint: python3 2_checkpoints.py``) under
``det-tasks run``. The counter's value is closed-form (``x = batches * increment_by``), so
every report, a stop at a checkpoint and the resumed run have exact answers."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from det_tasks.checkpoints import format as checkpoint_format
from det_tasks.runner import run_trial
from tests.integration.helpers import home_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "core_api"
REPORT = re.compile(r"report_training_metrics\(steps_completed=(\d+), metrics=\{'x': (\d+)\}\)")


def _det_tasks_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "det_tasks.runner.cli", "run", *args]


def _reports(stderr: str) -> list[tuple[int, int]]:
    return [(int(s), int(x)) for s, x in REPORT.findall(stderr)]


def test_sigterm_stops_the_script_at_its_checkpoint_and_resume_continues_exactly(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    params = ["-p", "hyperparameters.batches=300", "-p", "hyperparameters.increment_by=3"]
    slow = ["-p", "hyperparameters.batch_seconds=0.02"]
    proc = subprocess.Popen(
        _det_tasks_run(
            str(EXAMPLES / "checkpoints.yaml"),
            *params,
            *slow,
            "--no-progress",
            "--checkpoint-dir",
            str(checkpoints),
        ),
        cwd=tmp_path,
        env=home_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while proc.poll() is None and not list(checkpoints.glob("*/metadata.json")):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    found = re.fullmatch(
        r"stopped by SIGTERM at batch (\d+), checkpoint (\S+); continue with: (.*)",
        stderr.strip().splitlines()[-1],
    )
    assert found, stderr[-3000:]
    batch, reference, command = int(found.group(1)), found.group(2), found.group(3)
    assert 10 <= batch < 300 and batch % 10 == 0  # the script's own boundary
    assert checkpoint_format.verify(Path(reference))["steps_completed"] == batch
    assert (Path(reference) / "state").read_text() == f"{3 * batch},{batch},1"
    assert _reports(stderr) == [(n, 3 * n) for n in range(10, batch + 1, 10)]

    argv = shlex.split(command)
    assert argv[-2:] == ["--resume", reference]
    resumed = subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *argv[1:]],
        cwd=tmp_path,
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _reports(resumed.stderr) == [(n, 3 * n) for n in range(batch + 10, 301, 10)]
    summary = json.loads(resumed.stdout)
    assert summary["batches_trained"] == 300 and summary["validation"] == {"x": 900}


def test_searcher_length_and_hparams_reach_operations(tmp_path):
    result = run_trial(
        EXAMPLES / "hpsearch.yaml",
        checkpoint_dir=tmp_path,
        hparams={"increment_by": 2},
        max_batches=30,  # an ASHA rung's length, as a flow passes it
        progress=False,
    )
    assert result.sink.training == [(n, {"x": 2 * n}) for n in (10, 20, 30)]
    assert result.validation_metrics == {"x": 60}
    assert result.batches_trained == 30
    assert [c.steps_completed for c in result.sink.checkpoints] == [10, 20, 30]


def test_invalid_hp_early_exit_reaches_the_searcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import determined as det\n"
        "with det.core.init() as core_context:\n"
        "    if det.get_cluster_info().trial.hparams['lr'] > 1:\n"
        "        raise det.InvalidHP('lr too large')\n"
    )
    (tmp_path / "exp.yaml").write_text(
        "entrypoint: python3 train.py\nhyperparameters: {lr: 2}\n"
        "searcher: {name: single, metric: x}\n"
    )
    proc = subprocess.run(
        _det_tasks_run(str(tmp_path / "exp.yaml"), "--checkpoint-dir", str(tmp_path / "c")),
        cwd=tmp_path,
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "invalid hyperparameters" in proc.stderr


def test_a_flow_pause_reaches_should_preempt_and_activate_continues_exactly(tmp_path):
    """``python -m flows.experiment`` of the counter, paused (SIGINT to the flow, as ``kill
    -INT``): the script's segment stops at its own checkpoint, every run ends KILLED with
    det.state PAUSED, and ``--activate`` continues the same trial run to the exact end."""
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    params = [
        "hyperparameters.batches=300",
        "hyperparameters.increment_by=3",
        "searcher.max_length.batches=300",  # a flow's searcher needs a length
    ]
    proc = _flow(tmp_path, *params, "hyperparameters.batch_seconds=0.03")
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if any((tmp_path / "checkpoints").rglob("checkpoints/*/metadata.json")):
            break  # the segment stored its first checkpoint
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    activate = re.search(r"--activate ([0-9a-f-]{36})", stderr)
    assert activate, stderr[-3000:]
    client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("core-api-checkpoints")
    runs = client.search_runs([experiment.experiment_id])
    assert {(r.info.status, r.data.tags.get("det.state")) for r in runs} == {("KILLED", "PAUSED")}
    trial = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    stopped_at = checkpoint_records(client, trial.info.run_id)[-1]["steps_completed"]
    assert 10 <= stopped_at < 300 and stopped_at % 10 == 0

    resumed = _flow(tmp_path, *params, "--activate", activate.group(1))
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    history = client.get_metric_history(trial.info.run_id, "training/x")
    assert sorted((m.step, m.value) for m in history) == [(n, 3.0 * n) for n in range(10, 301, 10)]
    assert client.get_run(trial.info.run_id).data.metrics["validation/x"] == 900


def _flow(home: Path, *args: str) -> subprocess.Popen[str]:
    config = str(EXAMPLES / "checkpoints.yaml")
    if args and args[0] == "--config":
        config, args = args[1], args[2:]
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", config, *args],
        cwd=home,
        env=home_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _trial_runs(home: Path, experiment: str) -> list[tuple[int, list[tuple[int, float]]]]:
    """Each trial run's increment_by and its validation/x history (step, value)."""
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    found = client.get_experiment_by_name(experiment)
    trials = [
        r for r in client.search_runs([found.experiment_id]) if "mlflow.parentRunId" in r.data.tags
    ]
    return [
        (
            int(run.data.params["hp.increment_by"]),
            sorted(
                (m.step, m.value)
                for m in client.get_metric_history(run.info.run_id, "validation/x")
            ),
        )
        for run in trials
    ]


def test_a_grid_search_over_increment_by_reports_each_trials_exact_value(tmp_path):
    proc = _flow(tmp_path, "--config", str(EXAMPLES / "hpsearch.yaml"))
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    trials = sorted(_trial_runs(tmp_path, "core-api-hpsearch"))
    assert trials == [(1, [(50, 50.0)]), (2, [(50, 100.0)]), (3, [(50, 150.0)])]


def test_asha_rungs_are_the_operations_lengths_and_the_best_is_promoted(tmp_path):
    asha = [
        "searcher.name=adaptive_asha",
        "searcher.max_trials=4",
        "searcher.max_length.batches=40",
        "searcher.divisor=2",
        "searcher.max_rungs=3",
        "searcher.mode=aggressive",
        "hyperparameters.increment_by.vals=[1,2,3,4]",
    ]
    proc = _flow(tmp_path, "--config", str(EXAMPLES / "hpsearch.yaml"), *asha)
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    trials = _trial_runs(tmp_path, "core-api-hpsearch")
    assert len(trials) == 4
    for increment_by, history in trials:  # every rung's value is exact
        assert history and all(x == increment_by * step for step, x in history), history
        assert {step for step, _ in history} <= {10, 20, 40}
    best = max(increment_by for increment_by, _ in trials)
    reached = [max(step for step, _ in history) for inc, history in trials if inc == best]
    assert max(reached) == 40  # the searcher promoted (a trial of) the largest x to the end


def test_two_torch_distributed_processes_report_the_sum_and_resume_on_every_rank(tmp_path):
    """Stage 4: two ranks (torchrun, Gloo), rank r adding increment_by * (r + 1) a batch:
    the chief reports 2 * (1 + 2) * n after n batches, each rank stores its own counter in
    one sharded checkpoint; a run continued from it (restore_path on both ranks, in step)
    goes on exactly."""

    def run(*args: str) -> tuple[list[tuple[int, int]], dict]:
        proc = subprocess.run(
            _det_tasks_run(str(EXAMPLES / "distributed.yaml"), "--no-progress", *args),
            cwd=tmp_path,
            env=home_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _reports(proc.stderr), json.loads(proc.stdout.replace("[rank0]:", ""))

    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    reports, first = run(*checkpoints, "-p", "hyperparameters.batches=20")
    assert reports == [(10, 60), (20, 120)] and first["validation"] == {"x": 120}
    shards = Path(first["checkpoint"])
    assert [(shards / f"state-{r}").read_text() for r in (0, 1)] == ["20,40", "20,80"]

    reports, second = run(*checkpoints, "--resume", first["checkpoint"])
    assert reports == [(30, 180)] and second["validation"] == {"x": 180}
    shards = Path(second["checkpoint"])
    assert [(shards / f"state-{r}").read_text() for r in (0, 1)] == ["30,60", "30,120"]


def test_a_script_that_never_asks_should_preempt_runs_to_its_end_on_sigterm(tmp_path):
    """Determined's rule: a stop request the script never acknowledged does not make its
    end a pause (a second SIGTERM would stop it at once)."""
    (tmp_path / "train.py").write_text(
        "import pathlib, time\nimport determined as det\n"
        "with det.core.init() as core_context:\n"
        "    pathlib.Path('inside').touch()\n"
        "    for step in range(1, 31):\n"
        "        time.sleep(0.1)\n"
        "        if step % 10 == 0:\n"
        "            core_context.train.report_validation_metrics(step, {'x': step})\n"
    )
    (tmp_path / "exp.yaml").write_text(
        "entrypoint: python3 train.py\nsearcher: {name: single, metric: x}\n"
    )
    proc = subprocess.Popen(
        _det_tasks_run(str(tmp_path / "exp.yaml"), "--no-progress", "--checkpoint-dir", "c"),
        cwd=tmp_path,
        env=home_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while proc.poll() is None and not (tmp_path / "inside").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout)["validation"] == {"x": 30}
