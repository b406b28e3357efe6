"""A config without ``name:``, submitted with ``det experiment create``, is one experiment on
the real stack: one MLflow experiment named after the file, one parent run, every run ended,
and ``det experiment describe`` shows it. (The flow named it after the file and the worker
after the temporary file it rewrote the config to: two MLflow experiments, each with a run
left RUNNING, and describe showed the worker's.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from infra.stack import deploy
from registry.runs.run_records import EXPERIMENT_RUN_TAG, PARENT_TAG, TRIAL_TAG
from registry.runs.tracking import client_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def deployed(stack):
    deploy(stack)
    return stack


def nameless_model(folder: Path, stem: str) -> Path:
    """The submit tests' XOR model, its config without a name, saved as ``STEM.yaml``."""
    model = folder / "model"
    shutil.copytree(FIXTURES / "submit_model", model)
    shutil.copy(FIXTURES / "flow_model" / "model_def.py", model)
    text = (model / "const.yaml").read_text(encoding="utf-8")
    assert text.startswith("name: submit-xor\n")
    (model / f"{stem}.yaml").write_text(text.removeprefix("name: submit-xor\n"))
    return model


def test_a_nameless_config_is_one_experiment_with_one_parent_and_no_run_left_running(
    deployed, tmp_path, capsys
):
    from det_cli import main as det
    from det_cli.ids import experiment_run

    stem = f"noname-{uuid.uuid4().hex[:6]}"
    model = nameless_model(tmp_path, stem)
    det_bin = str(Path(sys.executable).with_name("det"))
    created = subprocess.run(
        [det_bin, "experiment", "create", f"{stem}.yaml", "."],
        cwd=model,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert created.returncode == 0, created.stderr[-3000:]
    short = next(line for line in created.stdout.splitlines() if line.startswith("Created "))
    short = short.split()[-1]
    waited = det(["experiment", "wait", short, "--polling-interval", "1"])
    if waited != 0:
        det(["e", "logs", short])
    assert waited == 0, capsys.readouterr().out[-4000:]
    capsys.readouterr()
    run_key = str(experiment_run(short).id)

    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    names = {e.experiment_id: e.name for e in client.search_experiments()}
    parents = client.search_runs(
        list(names), filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{run_key}'"
    )
    assert [names[p.info.experiment_id] for p in parents] == [stem]
    (parent,) = parents
    trials = client.search_runs(
        list(names), filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    )
    assert [t.data.tags[TRIAL_TAG] for t in trials] == ["1"]
    assert {t.info.experiment_id for t in trials} == {parent.info.experiment_id}
    assert [r.info.status for r in (parent, *trials)] == ["FINISHED", "FINISHED"]
    # Nothing the worker made elsewhere: no run of this experiment is RUNNING anywhere.
    running = client.search_runs(list(names), filter_string="attributes.status = 'RUNNING'")
    assert not [r for r in running if r.data.tags.get(PARENT_TAG) == parent.info.run_id]
    assert not any(name.startswith("config-") for name in names.values()), names
    assert trials[0].data.metrics["progress/batches"] == 30

    described = subprocess.run(
        [det_bin, "experiment", "describe", short], capture_output=True, text=True, timeout=120
    )
    assert described.returncode == 0, described.stderr
    assert f"MLflow experiment {stem!r} (id {parent.info.experiment_id}), parent run " \
        f"{parent.info.run_id}" in described.stdout, described.stdout  # fmt: skip
    assert trials[0].info.run_id in described.stdout


def assert_one_experiment(client, stem: str) -> None:
    """``stem`` is one MLflow experiment with one parent run, its trial runs under it, no
    run of it in any other experiment, and every run ended FINISHED."""
    experiment = client.get_experiment_by_name(stem)
    assert experiment is not None, stem
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if PARENT_TAG not in r.data.tags]
    trials = [r for r in runs if r.data.tags.get(PARENT_TAG) == parent.info.run_id]
    assert len(trials) == len(runs) - 1 >= 1
    assert {r.info.status for r in runs} == {"FINISHED"}, [
        (r.info.run_name, r.info.status) for r in runs
    ]
    everywhere = [e.experiment_id for e in client.search_experiments()]
    key = parent.data.tags[EXPERIMENT_RUN_TAG]
    parents = client.search_runs(everywhere, filter_string=f"tags.`{EXPERIMENT_RUN_TAG}` = '{key}'")
    assert [p.info.run_id for p in parents] == [parent.info.run_id]


def test_a_nameless_config_is_one_experiment_in_the_flow_and_det_tasks_run(deployed, tmp_path):
    """The other two ways in: ``python -m flows.experiment`` and ``det-tasks run``, each
    against the stack."""
    model = nameless_model(tmp_path, "unused")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    stems = {mode: f"noname-{mode}-{uuid.uuid4().hex[:6]}" for mode in ("flow", "run")}
    for stem in stems.values():
        shutil.copy(model / "unused.yaml", model / f"{stem}.yaml")
    commands = {
        "flow": ["-m", "flows.experiment", str(model / f"{stems['flow']}.yaml")],
        "run": ["-m", "det_tasks.runner.cli", "run", str(model / f"{stems['run']}.yaml"),
                str(model), "--no-progress"],
    }  # fmt: skip
    for mode, args in commands.items():
        done = subprocess.run(
            [sys.executable, *args], cwd=model, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (mode, done.stderr[-3000:])
    client = client_for(os.environ["MLFLOW_TRACKING_URI"])
    for stem in stems.values():
        assert_one_experiment(client, stem)
