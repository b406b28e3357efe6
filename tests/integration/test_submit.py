"""``det-tasks experiment create CONFIG DIR`` / ``job run CONFIG DIR`` against the real stack:
the model directory travels as an S3 package (``.detignore`` honoured, uploaded once per
content), runs on a worker whose working directory is an empty folder of its own, and bad
input is refused before anything is uploaded."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from det_tasks.runner.cli import main as det_tasks
from infra.services import start, stop
from infra.stack import deploy, prefect_worker_service
from registry.experiments.view import describe_experiment_run
from registry.runs.tracking import client_for
from tests.integration.helpers import env_without_platform

SUBMIT_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "submit_model"
FLOW_MODEL = SUBMIT_MODEL.parent / "flow_model"

REMOTE_YAML = """\
name: det-tasks-remote-test
prefect-version: 3.8.8
pull:
  - prefect.deployments.steps.set_working_directory:
      directory: "{workdir}"
deployments:
  - name: remote
    entrypoint: flows.experiment.experiment
    work_pool: {{name: remote}}
  - name: remote
    entrypoint: flows.batch_inference.batch_inference
    work_pool: {{name: remote}}
"""


def s3():
    return boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"])


def packages() -> set[str]:
    listing = s3().list_objects_v2(Bucket="det-tasks", Prefix="packages/")
    return {o["Key"] for o in listing.get("Contents", [])}


def prefect(*args: str, cwd: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def deployed(stack):
    """The stack's deployments (experiment/submitted, ...), registered once per module."""
    deploy(stack)
    return stack


@pytest.fixture(scope="module")
def remote_worker(deployed, stack, tmp_path_factory):
    """A second process worker on pool `remote`, started in an empty folder that shares
    nothing with the submitting side but the stack's URLs and S3 credentials."""
    workdir = tmp_path_factory.mktemp("remote-worker")
    spec_dir = tmp_path_factory.mktemp("remote-spec")
    (spec_dir / "prefect.yaml").write_text(REMOTE_YAML.format(workdir=workdir))
    subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", "remote", "--type", "process"],
        cwd=spec_dir,
        capture_output=True,
        timeout=120,
    )
    prefect(
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        str(spec_dir / "prefect.yaml"),
        cwd=spec_dir,
    )
    worker = prefect_worker_service(stack, pool="remote", workdir=workdir)
    start(worker)
    try:
        yield workdir
    finally:
        stop(worker)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """The fixture model plus files a .detignore keeps at home."""
    model = tmp_path / "model"
    shutil.copytree(SUBMIT_MODEL, model)
    shutil.copy(FLOW_MODEL / "model_def.py", model)  # the flow tests' XOR trial
    (model / ".detignore").write_text("data/\n*.ckpt\n")
    (model / "data").mkdir()
    (model / "data" / "huge.bin").write_bytes(b"\0" * 4096)
    (model / "old.ckpt").write_bytes(b"old")
    return model


def package_names(key: str) -> set[str]:
    body = s3().get_object(Bucket="det-tasks", Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        return set(tar.getnames())


def created_id(output: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith("Created "))
    return line.split()[-1]


def test_create_ships_code_once_runs_on_a_remote_worker_and_job_run_predicts(
    stack, remote_worker, model_dir, capsys
):
    before = packages()
    # 1. experiment create --follow on the stack's own worker.
    assert (
        det_tasks(
            ["experiment", "create", str(model_dir / "const.yaml"), str(model_dir), "--follow"]
        )
        == 0
    )
    out = capsys.readouterr().out
    first = created_id(out)
    assert "Uploaded package" in out and "MLflow experiment: http" in out
    new = packages() - before
    assert len(new) == 1
    key = new.pop()
    names = package_names(key)
    assert {"model_def.py", "const.yaml", "batch_inference.py", ".detignore"} <= names
    assert not any(n.startswith("data") or n.endswith(".ckpt") for n in names)

    # 2. The same code again, to the worker that runs in an empty folder: not re-uploaded.
    assert (
        det_tasks(
            [
                "experiment",
                "create",
                str(model_dir / "const.yaml"),
                str(model_dir),
                "--deployment",
                "experiment/remote",
                "--follow",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    second = created_id(out)
    assert "Reusing identical, already uploaded package" in out
    assert packages() - before == {key}
    assert not any(p.name.startswith("det-tasks-model") for p in remote_worker.iterdir())

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    for run_key in (first, second):
        view = describe_experiment_run(client, run_key)
        assert view is not None and len(view.trials) == 1
        assert view.trials[0].batches == 30 and view.trials[0].state == "COMPLETED"
        assert view.trials[0].checkpoint

    # 3. list / describe show the runs from Prefect and MLflow.
    assert det_tasks(["experiment", "list"]) == 0
    listing = capsys.readouterr().out
    assert first in listing and second in listing and "submit-xor" in listing
    assert det_tasks(["experiment", "describe", second[:8]]) == 0
    described = capsys.readouterr().out
    trial_run = describe_experiment_run(client, second).trials[0]
    assert trial_run.run_id in described and "COMPLETED" in described

    # 4. job run: the Trainer-API batch_inference.py, trial named by its MLflow run id,
    # on the remote worker; its predictions land in S3.
    config = model_dir / "batch_inference.yaml"
    config.write_text(config.read_text().replace("REPLACED_BY_THE_TEST", trial_run.run_id))
    assert (
        det_tasks(
            [
                "job",
                "run",
                str(config),
                str(model_dir),
                "--deployment",
                "batch-inference/remote",
                "--follow",
            ]
        )
        == 0
    )
    job_id = created_id(capsys.readouterr().out)
    body = s3().get_object(Bucket="det-tasks", Key=f"jobs/{job_id}/predictions.pt")["Body"]
    predictions = torch.load(io.BytesIO(body.read()))
    assert predictions.shape == (40, 1)
    from det_tasks import compat
    from det_tasks.pytorch import load_trial_from_checkpoint_path

    compat.install()
    # By path: other tests have imported other `model_def` modules in this session.
    spec = importlib.util.spec_from_file_location("submit_model_def", model_dir / "model_def.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trial = load_trial_from_checkpoint_path(trial_run.checkpoint)
    with torch.no_grad():
        expected = trial.context.models[0](module.XorData(40).x)
    torch.testing.assert_close(predictions, expected)


def test_oversized_directory_is_refused_naming_the_largest_files(stack, model_dir, capsys):
    (model_dir / "weights.bin").write_bytes(os.urandom(2 * 2**20))
    before = packages()
    code = det_tasks(
        [
            "experiment",
            "create",
            str(model_dir / "const.yaml"),
            str(model_dir),
            "--max-package-mb",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "weights.bin (2.0 MB)" in err and "over the 1 MB limit" in err and ".detignore" in err
    assert packages() == before


def test_bad_config_is_refused_before_upload(stack, model_dir, capsys):
    bad = model_dir / "bad.yaml"
    bad.write_text((model_dir / "const.yaml").read_text().replace("max_length", "max_lenght"))
    before = packages()
    assert det_tasks(["experiment", "create", str(bad), str(model_dir)]) == 1
    err = capsys.readouterr().err
    assert "max_lenght" in err and "max_length" in err
    assert det_tasks(["job", "run", str(model_dir / "const.yaml"), str(model_dir)]) == 1
    assert "unknown field" in capsys.readouterr().err
    assert packages() == before


MNIST = Path(__file__).resolve().parents[2] / "examples" / "mnist"


def test_det_runs_the_mnist_tutorial_verbatim(deployed, tmp_path, monkeypatch, capsys):
    """The tutorial's `det experiment create const.yaml .` in a copy of examples/mnist (made a
    few batches long), then `det experiment wait ID` and `det experiment list-checkpoints ID`."""
    from det_cli import main as det

    workdir = tmp_path / "mnist"
    shutil.copytree(MNIST, workdir)
    monkeypatch.chdir(workdir)
    # A few batches; checkpoints to the stack's S3 (the tutorial's shared_fs is a folder
    # on whichever host the worker runs on).
    short = ["--config", "searcher.max_length={batches: 4}", "--config",
             "min_validation_period={batches: 4}", "--config",
             "checkpoint_storage={type: s3, bucket: det-tasks}"]  # fmt: skip
    created = subprocess.run(
        [str(Path(sys.executable).with_name("det")), "experiment", "create", "const.yaml", ".",
         *short],
        cwd=workdir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr[-3000:]
    exp_id = created_id(created.stdout)
    assert len(exp_id) == 8 and int(exp_id, 16) >= 0, created.stdout

    waited = det(["experiment", "wait", exp_id, "--polling-interval", "1"])
    if waited != 0:
        det(["e", "logs", exp_id])
    assert waited == 0, capsys.readouterr().out[-4000:]
    assert f"Experiment {exp_id} terminated with state COMPLETED" in capsys.readouterr().out
    # Its logs, read over Prefect's REST API: the flow's, then one trial's task runs only.
    assert det(["e", "logs", exp_id]) == 0
    flow_lines = capsys.readouterr().out.splitlines()
    assert any(
        re.fullmatch(r"\d\d:\d\d:\d\d .*1 trial\(s\) to start.*", line) for line in flow_lines
    )
    assert det(["t", "logs", f"{exp_id}/1"]) == 0
    trial_lines = capsys.readouterr().out.splitlines()
    assert trial_lines and len(trial_lines) < len(flow_lines), trial_lines
    assert not any("trial(s) to start" in line for line in trial_lines)
    assert det(["e", "lc", exp_id]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) >= 1 and rows[0].split()[1] == "4", rows

    # Trials are named EXPERIMENT/N; an unknown experiment is one line and changes nothing.
    assert det(["e", "lt", exp_id]) == 0
    assert f"{exp_id}/1" in capsys.readouterr().out
    unknown = "0" * 8 if not exp_id.startswith("0" * 8) else "f" * 8
    assert det(["e", "describe", unknown]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"det: error: no experiment runs match {unknown!r}: give more characters"
    ]


def _trial_run(client, name: str, timeout: float = 180):
    """The MLflow run of trial 1 of the experiment ``name``, once it has trained a batch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            runs = client.search_runs([experiment.experiment_id], "tags.`det.trial_id` = '1'")
            if runs and runs[0].data.metrics.get("progress/batches", 0) > 0:
                return runs[0]
        time.sleep(0.5)
    raise AssertionError(f"experiment {name} trained no batch in {timeout} s")


def _until(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held (polled every 0.2 s)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - start


def _numbers_agree(det_bin: str, short: str, client, run_id: str, state: str) -> int:
    """`det experiment describe`, the flow run's trials table (its one artifact, as last
    published) and MLflow say the same of trial 1: its state, the batches it trained and
    its best validation_loss and the batch of it. Returns the batches."""
    from det_cli.ids import experiment_run
    from flows.trial_table import significant
    from tests.integration.prefect_artifacts import trials_table_and_progress

    run = client.get_run(run_id)
    history = client.get_metric_history(run_id, "validation/validation_loss")
    best_step, best = min(((m.step, m.value) for m in history), key=lambda p: (p[1], p[0]))
    batches = int(run.data.metrics["progress/batches"])
    assert run.data.tags["det.state"] == state
    described = subprocess.run(
        [det_bin, "experiment", "describe", short], capture_output=True, text=True, timeout=60
    )
    assert described.returncode == 0, described.stderr
    row = next(line.split() for line in described.stdout.splitlines() if line.startswith("1 "))
    assert row[:5] == ["1", state, str(batches), f"{best:.6g}", str(best_step)], described.stdout
    (table_row,), _ = trials_table_and_progress(experiment_run(short).id)
    shown = [table_row[k] for k in ("state", "batches", "best validation_loss", "best at batch")]
    assert shown == [state, batches, significant(best), best_step], table_row
    return batches


def _task_runs(flow_run_id) -> dict[str, object]:
    """The flow run's task runs by name (the newest of a name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as prefect:
        tasks = prefect.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {t.name: t for t in sorted(tasks, key=lambda t: t.created)}


def test_pause_activate_and_cancel_an_experiment_on_the_stack(deployed, tmp_path, monkeypatch):
    """det experiment pause stops the trial at a batch boundary with a checkpoint there and
    frees its worker; with every worker replaced meanwhile, activate continues the same
    MLflow run from that checkpoint to the end, in a train task named from where it starts;
    Prefect's cancel (what the UI's Cancel button does) stops a second experiment's training
    on its worker within seconds, its runs KILLED with det.state CANCELED; det experiment
    kill ends a third one's flow run Cancelled with one line and no traceback, its train
    task Cancelled. After each, describe, the trials table and MLflow give the same state,
    batches and best."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.states import Cancelling

    from det_cli import main as det
    from det_cli.ids import experiment_run
    from det_tasks.pytorch import load_trial_from_checkpoint_path
    from registry.checkpoints.store import checkpoint_records

    workdir = tmp_path / "xor"
    shutil.copytree(FLOW_MODEL, workdir)
    monkeypatch.chdir(workdir)
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    det_bin = str(Path(sys.executable).with_name("det"))
    slow = ["--config", "hyperparameters.sleep_s=0.1",
            "--config", "min_validation_period={batches: 20}"]  # fmt: skip

    def create(name: str, length: int = 300) -> str:
        created = subprocess.run(
            [det_bin, "experiment", "create", "killable.yaml", ".", "--config", f"name={name}",
             *slow, "--config", f"searcher.max_length={{batches: {length}}}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr[-3000:]
        return created_id(created.stdout)

    def batches(run_id: str) -> int:
        return int(client.get_run(run_id).data.metrics.get("progress/batches", 0))

    # Pause: a checkpoint at the stop batch, the run KILLED/PAUSED, nothing trains on.
    paused_name = f"lifecycle-{uuid.uuid4().hex[:6]}"
    exp_id = create(paused_name)
    trial = _trial_run(client, paused_name)
    run_id = trial.info.run_id
    assert det(["experiment", "pause", exp_id]) == 0
    _until(lambda: client.get_run(run_id).info.status == "KILLED", 60, "pause")
    stopped_at = batches(run_id)
    assert client.get_run(run_id).data.tags["det.state"] == "PAUSED"
    assert checkpoint_records(client, run_id)[-1]["steps_completed"] == stopped_at
    assert 0 < stopped_at < 300
    _until(lambda: experiment_run(exp_id).state == "PAUSED", 60, "flow run suspended")
    assert _numbers_agree(det_bin, exp_id, client, run_id, "PAUSED") == stopped_at
    time.sleep(3)
    assert batches(run_id) == stopped_at  # the worker no longer trains it
    assert det(["experiment", "pause", exp_id]) == 1  # pausing twice: one line, no change

    # Every worker process is replaced while it is paused (nothing holds the trial in
    # memory any more): activate must restore it from the pause checkpoint.
    from distributed import Client

    from cluster.startup import SCHEDULER_ENV

    with Client(os.environ[SCHEDULER_ENV], timeout=30, set_as_default=False) as dask:
        dask.restart(wait_for_workers=True)

    # Activate: the same run goes on from its pause checkpoint to the end.
    assert det(["experiment", "activate", exp_id]) == 0
    assert det(["experiment", "wait", exp_id, "--polling-interval", "1"]) == 0
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED" and batches(run_id) == 300
    assert _numbers_agree(det_bin, exp_id, client, run_id, "COMPLETED") == 300
    tasks = _task_runs(experiment_run(exp_id).id)
    paused_task = tasks["train trial-1 0-300"]  # stopped by the pause: not Completed
    assert paused_task.state.type.value == "CANCELLED", paused_task.state
    assert f"paused at batch {stopped_at}" in (paused_task.state.message or "")
    assert tasks[f"train trial-1 {stopped_at}-300"].state.type.value == "COMPLETED", sorted(tasks)
    assert checkpoint_records(client, run_id)[-1]["steps_completed"] == 300
    history = client.get_metric_history(run_id, "progress/batches")
    resumed = [p.step for p in history if p.step <= stopped_at]
    assert len(resumed) == len(set(resumed))  # nothing before the pause was trained twice
    experiment = client.get_experiment_by_name(paused_name)
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 2  # same parent, same trial
    # Bit-equal to the same trial never paused, trained in one local process (sleep_s only
    # sleeps: it changes no number).
    reference_dir = tmp_path / "reference"
    reference = subprocess.run(
        [str(Path(sys.executable).with_name("det-tasks")), "run", "killable.yaml", ".",
         "-p", "hyperparameters.sleep_s=0", "-p", "searcher.max_length={batches: 300}",
         "-p", "min_validation_period={batches: 20}",
         "--checkpoint-dir", str(reference_dir), "--no-progress"],
        env=env_without_platform(DET_TASKS_HOME=str(tmp_path / "home")),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    newest = max(reference_dir.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    got = load_trial_from_checkpoint_path(checkpoint_records(client, run_id)[-1]["uri"])
    want = load_trial_from_checkpoint_path(str(newest.parent), trial_class=type(got))
    for a, b in zip(want.model.state_dict().values(), got.model.state_dict().values()):
        assert torch.equal(a, b)

    # Prefect's cancel: training stops on the worker within seconds, runs end KILLED.
    cancelled_name = f"lifecycle-{uuid.uuid4().hex[:6]}"
    cancel_id = create(cancelled_name)
    killed_name = f"lifecycle-{uuid.uuid4().hex[:6]}"
    # Trains beside it, on the other worker, long enough (at least 300 s) that the kill
    # always finds it training, however soon its flow starts.
    kill_id = create(killed_name, length=3000)
    trial = _trial_run(client, cancelled_name)
    flow_run = experiment_run(cancel_id)
    with get_client(sync_client=True) as prefect:
        prefect.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    took = _until(lambda: client.get_run(trial.info.run_id).info.status == "KILLED", 60, "cancel")
    assert took <= 10, f"training went on {took:.1f} s after the cancel"
    halted = batches(trial.info.run_id)
    time.sleep(3)
    assert batches(trial.info.run_id) == halted
    experiment = client.get_experiment_by_name(cancelled_name)
    assert experiment is not None
    ended = client.search_runs([experiment.experiment_id])
    assert {r.info.status for r in ended} == {"KILLED"}
    assert {r.data.tags.get("det.state") for r in ended} == {"CANCELED"}

    # det experiment kill: no checkpoint; the flow run ends Cancelled, saying so in one line.
    killed = _trial_run(client, killed_name)
    assert det(["experiment", "kill", kill_id]) == 0
    _until(lambda: experiment_run(kill_id).state == "CANCELLED", 60, "kill")
    at = _numbers_agree(det_bin, kill_id, client, killed.info.run_id, "CANCELED")
    kill_run = experiment_run(kill_id)
    task = _task_runs(kill_run.id)["train trial-1 0-3000"]
    assert task.state.type.value == "CANCELLED", task.state
    killed_at = re.search(r"killed \(no checkpoint\) at batch (\d+)", task.state.message or "")
    # The harness reports training at scheduling-unit ends, at a checkpoint or validation,
    # not when a kill breaks its loop: MLflow's last progress/batches can be a few batches
    # short of where the trial stopped.
    assert killed_at is not None and int(killed_at.group(1)) >= at, task.state
    logs: list[str] = []

    def kill_logged() -> bool:
        # The flow's last lines reach the server from its log worker after its state did.
        with get_client(sync_client=True) as prefect:
            logs[:] = [
                log.message
                for log in prefect.read_logs(
                    LogFilter(flow_run_id=LogFilterFlowRunId(any_=[kill_run.id]))
                )
            ]
        return any("killed (no checkpoint)" in m for m in logs)

    _until(kill_logged, 30, "the kill's line in the flow run's log")
    assert not any("Traceback" in m or "unexpected exception" in m for m in logs), logs[-5:]
    assert det(["experiment", "list"]) == 0  # sweeps orphans first: none here
