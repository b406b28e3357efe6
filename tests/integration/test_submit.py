"""``det-tasks experiment create CONFIG DIR`` / ``job run CONFIG DIR`` against the real stack:
the model directory travels as an S3 package (``.detignore`` honoured, uploaded once per
content), runs on a worker whose working directory is an empty folder of its own, and bad
input is refused before anything is uploaded."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import boto3
import pytest
import torch

from det_tasks.runner.cli import main as det_tasks
from infra.services import start, stop
from infra.stack import deploy, prefect_worker_service
from registry.experiment_view import describe_experiment_run
from registry.tracking import client_for

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
        assert view.trials[0].batches == 30 and view.trials[0].state == "FINISHED"
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
    from flows.det_cli import main as det

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
