"""A ``core_v2`` script launched by the platform (``det-tasks run``): as in Determined, the
script's ``Config`` is ignored and ``core_v2``'s globals are the trial's own context, so
its hparams, reports and checkpoints are the trial's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from det_tasks.checkpoints import format as checkpoint_format
from tests.integration.helpers import home_env

SCRIPT = """\
from determined.experimental import core_v2

core_v2.init(config=core_v2.Config(name="ignored-when-launched", hparams={"increment_by": 1}))
step = core_v2.info.trial.hparams["increment_by"]
x = 0
for batch in range(20):
    x += step
    if (batch + 1) % 10 == 0:
        core_v2.train.report_training_metrics(steps_completed=batch + 1, metrics={"x": x})
with core_v2.checkpoint.store_path({"steps_completed": 20}) as (path, _):
    path.joinpath("state").write_text(str(x))
core_v2.train.report_validation_metrics(steps_completed=20, metrics={"x": x})
core_v2.close()
"""
CONFIG = """\
name: core-v2-launched
entrypoint: python3 train.py
hyperparameters: {increment_by: 4}
searcher: {name: single, metric: x, smaller_is_better: false}
"""


def test_a_launched_core_v2_script_reports_as_its_trial(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "exp.yaml").write_text(CONFIG)
    run = [sys.executable, "-m", "det_tasks.runner.cli", "run", "exp.yaml", "--no-progress"]
    done = subprocess.run(
        [*run, "--checkpoint-dir", str(tmp_path / "checkpoints")],
        cwd=tmp_path,
        env=home_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report_training_metrics(steps_completed=10, metrics={'x': 40})" in done.stderr
    assert "report_training_metrics(steps_completed=20, metrics={'x': 80})" in done.stderr
    summary = json.loads(done.stdout)
    assert summary["batches_trained"] == 20 and summary["validation"] == {"x": 80}
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint_format.verify(checkpoint)["steps_completed"] == 20
    assert (checkpoint / "state").read_text() == "80"
