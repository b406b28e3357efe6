"""A full disk under a flow's checkpoints ends the experiment with one line and leaves it
resumable (``python -m flows.experiment``, no servers, its artifact folder on an 8 MiB
tmpfs, a 3.2 MB checkpoint): the third checkpoint does not fit. The last line names the
full folder, the last good checkpoint (batch 60) and the ``--activate`` command; nothing
partial is left; the runs end KILLED with det.state PAUSED, not FAILED. Once there is room
(the tmpfs grown to 64 MiB), the printed command trains on from batch 60 to weights
bit-equal to an undisturbed run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import (
    FLOW_MODEL,
    environment,
    home_env,
    killable_runs,
    undisturbed_weights,
)
from tests.unit.test_disk_full import small_filesystem

CONFIG = FLOW_MODEL / "killable.yaml"  # one trial, 120 batches, checkpoints every 30
# A 3.2 MB checkpoint (the weights and SGD's momentum, 100,000 hidden units): two fit in
# 8 MiB, the third does not.
BIG_MODEL = ("hyperparameters.hidden=100000", "hyperparameters.sleep_s=0")


def _experiment(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.experiment", str(CONFIG), *BIG_MODEL, *args],
        cwd=home,
        env=home_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _published(artifacts: Path) -> tuple[list[Path], list[Path]]:
    """The checkpoint folders under ``artifacts`` (sealed with metadata.json) and anything
    else left in the folders that hold them (partial uploads)."""
    sealed = sorted(p.parent for p in artifacts.rglob("checkpoints/*/metadata.json"))
    holders = {p.parent for p in sealed}
    others = [p for h in holders for p in h.iterdir() if p not in sealed]
    return sealed, others


@pytest.mark.slow  # three runs of a 100,000-unit model: 87 s here, 10 min at load 20
def test_a_full_disk_pauses_the_flow_with_one_line_and_activate_trains_on(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records

    artifacts = tmp_path / "det" / "artifacts"  # the flow's artifact and checkpoint folder
    with small_filesystem(artifacts, "8m"):
        first = _experiment(tmp_path)
        assert first.returncode == 130, first.stderr[-3000:]
        last = first.stderr.strip().splitlines()[-1]
        assert len(last) < 600 and "[(" not in last and "Errno" not in last, last
        assert "is full (No space left on device)" in last, last
        assert str(artifacts) in last, last
        assert "nothing partial was left" in last, last
        assert "its last good checkpoint is at batch 60 (runs:/" in last, last
        match = re.search(r"once there is room, continue with: .*--activate ([0-9a-f-]{36})$", last)
        assert match, last

        sealed, partial = _published(artifacts)
        assert len(sealed) == 2 and partial == [], (sealed, partial)
        runs = killable_runs(tmp_path)
        assert {r.info.status for r in runs} == {"KILLED"}
        assert {r.data.tags.get("det.state") for r in runs} == {"PAUSED"}
        trial = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
        with environment(replace=home_env(tmp_path)):
            from registry.runs.tracking import client_for

            client = client_for(f"sqlite:///{(tmp_path / 'det' / 'mlflow.db').resolve()}")
        assert [r["steps_completed"] for r in checkpoint_records(client, trial.info.run_id)] == [
            30,
            60,
        ]

        grown = subprocess.run(
            ["mount", "-o", "remount,size=64m", str(artifacts)], capture_output=True, text=True
        )
        assert grown.returncode == 0, grown.stderr
        resumed = _experiment(tmp_path, "--activate", match.group(1))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert (
            "restored from" in resumed.stderr
            and "batch 0" not in resumed.stderr.split("restored from", 1)[1][:40]
        )
        runs_after = killable_runs(tmp_path)
        assert sorted(r.info.run_id for r in runs_after) == sorted(r.info.run_id for r in runs)
        assert {r.info.status for r in runs_after} == {"FINISHED"}
        records = checkpoint_records(client, trial.info.run_id)
        assert records[-1]["steps_completed"] == 120
        with environment(
            replace=home_env(tmp_path),
            MLFLOW_TRACKING_URI=f"sqlite:///{(tmp_path / 'det' / 'mlflow.db')}",
        ):
            got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
            got_weights = {k: v.clone() for k, v in got.model.state_dict().items()}
    want = undisturbed_weights(tmp_path, *BIG_MODEL)
    assert list(want) == list(got_weights)
    for name, tensor in want.items():
        assert torch.equal(tensor, got_weights[name]), name
