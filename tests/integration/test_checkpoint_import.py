"""Issue 15 item 10: `det-tasks checkpoints import` adopts Determined-written checkpoints:
signed with this installation's key, uploaded and recorded under an MLflow experiment, and
loadable afterwards with their trained weights. Real MLflow (SQLite store, local artifacts);
the S3 source path is the stack's (test_registry covers boto3 transfers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1] / "fixtures" / "determined-legacy"
X = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("MLFLOW_S3_ENDPOINT_URL", "DET_TASKS_MLFLOW_ARTIFACTS", "AWS_ENDPOINT_URL"):
        env.pop(name, None)
    env.update(
        MLFLOW_TRACKING_URI=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}",
        DET_TASKS_ARTIFACT_ROOT=str(tmp_path / "artifacts"),
        DET_TASKS_HOME=str(tmp_path / "home"),
        DET_TASKS_CACHE_DIR=str(tmp_path / "cache"),
    )
    return env


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "det_tasks.runner.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_import_adopts_every_layout_signed_and_registered(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    env = _env(tmp_path)
    sources = []
    for i, layout in enumerate(sorted(p for p in ROOT.iterdir() if p.is_dir())):
        # Determined names checkpoint directories by uuid; that uuid is kept.
        dest = tmp_path / "old" / f"00000000-0000-4000-8000-{i:012d}"
        shutil.copytree(layout, dest)
        sources.append(str(dest))
    proc = _cli(["checkpoints", "import", *sources, "--experiment", "from-determined"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    uris = [line.split()[-1] for line in proc.stdout.splitlines()[2:]]
    assert len(uris) == 8 and all(u.startswith("runs:/") for u in uris)
    assert [u.rsplit("/", 1)[-1] for u in uris] == [Path(s).name for s in sources]

    listed = _cli(["checkpoints", "from-determined"], env)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert sum("runs:/" in line for line in listed.stdout.splitlines()) == 8

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from det_tasks.checkpoints.format import verify
    from det_tasks.checkpoints.trust import is_signed_here
    from det_tasks.pytorch import load_trial_from_checkpoint_path
    from registry.checkpoints.uris import fetch_checkpoint_uri as _fetch

    expected = json.loads((ROOT / "expected_logits.json").read_text())
    for uri in uris:
        local = _fetch(uri)
        meta = verify(local)
        assert is_signed_here(local, meta)  # adopted: code loads without trust_code
        assert (
            meta["determined_metadata"] is None
            or "determined_version" in meta["determined_metadata"]
        )
        trial = load_trial_from_checkpoint_path(str(local))
        assert trial.model(X).detach().squeeze(1).tolist() == expected

    # Warm start from the registry: a uuid this trial's storage does not hold, or a trial
    # id (the imported trial 7: its most recent checkpoint, 0.21-metadata is the last).
    from det_tasks.checkpoints.store import LocalDirectoryStore
    from det_tasks.pytorch._loop.warm_start import warm_start_reference

    store = LocalDirectoryStore(tmp_path / "elsewhere")
    by_uuid = {"searcher": {"source_checkpoint_uuid": Path(sources[0]).name}}
    assert warm_start_reference(by_uuid, store) == uris[0]
    by_trial = {"searcher": {"source_trial_id": "determined-7"}}
    assert warm_start_reference(by_trial, store) == uris[-1]


def test_import_refuses_a_tampered_pickle_and_imports_nothing(tmp_path):
    pytest.importorskip("mlflow")
    env = _env(tmp_path)
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    shutil.copytree(ROOT / "0.19-trial-state", good)
    shutil.copytree(ROOT / "0.19-trial-state", bad)
    (bad / "trial_state.pkl").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.")
    proc = _cli(["checkpoints", "import", str(good), str(bad)], env)
    assert proc.returncode != 0
    assert "os.system, which is not one of the data types Determined wrote" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "artifacts").exists()


def test_import_from_s3_on_the_stack(stack):
    """A Determined checkpoint left in S3 storage (its uuid as the prefix) is adopted from
    there: downloaded with the stack's keys, registered, and loadable by its runs:/ URI."""
    from det_tasks.pytorch import load_trial_from_checkpoint_path
    from registry.checkpoints.importer import import_checkpoints
    from registry.runs.tracking import client_for
    from registry.servers import s3 as s3_lib
    from registry.servers.settings import RegistrySettings

    settings = RegistrySettings.from_env()
    s3 = s3_lib.client()
    uuid = "11111111-2222-4333-8444-555555555555"
    layout = ROOT / "0.17-workload-sequencer-latest-batch"
    for path in layout.rglob("*"):
        if path.is_file():
            key = f"old-determined/{uuid}/{path.relative_to(layout).as_posix()}"
            s3.upload_file(str(path), "det-tasks", key)
    (imported,) = import_checkpoints(
        client_for(str(settings.tracking_uri)),
        s3,
        [f"s3://det-tasks/old-determined/{uuid}"],
        "from-determined-s3",
        artifacts_destination=settings.artifacts_destination,
    )
    assert imported.uuid == uuid and imported.steps_completed == 120
    assert imported.trial_cls_spec == "model_def:XorTrial"
    trial = load_trial_from_checkpoint_path(imported.uri)
    expected = json.loads((ROOT / "expected_logits.json").read_text())
    assert trial.model(X).detach().squeeze(1).tolist() == expected
