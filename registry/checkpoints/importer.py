"""``det-tasks checkpoints import``: adopt checkpoints Determined wrote into this installation.

A migrating team points it at Determined checkpoint directories (local, or ``s3://``
prefixes of their old checkpoint storage) that they have reviewed. Each one is read
safely first (the allow-listed unpickler of det_tasks.checkpoints.safe_unpickle; its code is never
imported), completed where its Determined version left things out (``load_data.json``
with the trial class, from the config's entrypoint), sealed and signed with this
installation's key (so ``load_trial_from_checkpoint_path`` will rebuild its trial without
``trust_code``), uploaded under an MLflow trial run of one import run of the experiment,
and recorded there like a checkpoint this platform trained. Determined's own
``metadata.json`` is kept under ``determined_metadata``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
import time
import uuid as uuid_lib
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.safe_unpickle import load_pickle
from det_tasks.checkpoints.trial_class import read_load_data, trial_class_spec
from det_tasks.errors import CheckpointError
from registry.checkpoints.store import record_checkpoint, run_checkpoint_location
from registry.runs.tracking import ExperimentRuns
from registry.runs.trial_states import Progress
from registry.servers.s3 import download_prefix, parse_location, upload_dir

__all__ = ["ImportedCheckpoint", "adopt_directory", "import_checkpoints"]

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclasses.dataclass(frozen=True)
class ImportedCheckpoint:
    source: str
    uuid: str
    uri: str
    trial_id: str
    run_id: str
    steps_completed: int
    trial_cls_spec: str


def import_checkpoints(
    client: MlflowClient,
    s3: Any,
    sources: list[str],
    experiment: str,
    *,
    artifacts_destination: str | None,
) -> list[ImportedCheckpoint]:
    """Adopt every source (a directory or ``s3://`` prefix holding one checkpoint) into one
    import run of ``experiment``. All sources are read and checked before anything is
    uploaded, so one bad checkpoint leaves nothing half-imported."""
    if not sources:
        raise CheckpointError("give at least one checkpoint directory or s3:// prefix to import")
    with tempfile.TemporaryDirectory(prefix="det-import-") as tmp:
        adopted = [
            adopt_directory(_local_copy(s3, source, Path(tmp) / f"src{i}"), Path(tmp), source)
            for i, source in enumerate(sources)
        ]
        first_config = json.loads((adopted[0] / ckpt.LOAD_DATA_FILE).read_text())
        runs = ExperimentRuns(
            client,
            experiment,
            f"import-{uuid_lib.uuid4().hex}",
            first_config.get("experiment_config") or {},
        )
        client.set_tag(runs.parent_run_id, "det.imported_from", "determined")
        done = [_register(client, s3, runs, path, artifacts_destination) for path in adopted]
        for run_id in {d.run_id for d in done}:
            runs.finish(run_id, progress=Progress.recorded_elsewhere())
        runs.finish(runs.parent_run_id)
        return [dataclasses.replace(d, source=s) for d, s in zip(done, sources)]


def adopt_directory(source_dir: Path, workdir: Path, source: str) -> Path:
    """A sealed, signed copy of one Determined checkpoint, in ``workdir/<uuid>``; the uuid
    is the source directory's name when that is one (Determined names them so)."""
    ckpt.verify(source_dir)
    state = ckpt.read_state(source_dir)  # allow-listed: proves the pickles are only data
    if not (state.get("models_state_dict") or state.get("model_state_dict")):
        raise CheckpointError(
            f"{source}: state_dict.pth holds no model weights; is it a PyTorchTrial checkpoint?"
        )
    progress = ckpt.determined_progress(source_dir)
    load_data = read_load_data(source_dir)
    spec = trial_class_spec(source_dir, load_data)
    name = Path(source.rstrip("/")).name
    uuid = name if _UUID.match(name) else str(uuid_lib.uuid4())
    target = workdir / uuid
    if target.exists():
        raise CheckpointError(f"{source}: checkpoint {uuid} is given twice")
    shutil.copytree(source_dir, target, ignore=shutil.ignore_patterns("__pycache__"))
    determined_meta = _pop_metadata(target)
    ckpt.write_json(
        target / ckpt.LOAD_DATA_FILE,
        {
            "trial_type": load_data.get("trial_type", "PyTorchTrial"),
            "trial_cls_spec": spec,
            "hparams": load_data.get("hparams") or {},
            "experiment_config": load_data.get("experiment_config"),
        },
    )
    ckpt.seal(
        target,
        {
            "steps_completed": progress["batches_trained"],
            "trial_id": str(_trial_id(source_dir) or uuid),
            "imported_from": source,
            "imported_at": time.time(),
            "determined_metadata": determined_meta,
            "validation_metrics": None,
        },
    )
    return target


def _pop_metadata(target: Path) -> dict[str, Any] | None:
    path = target / ckpt.METADATA_FILE
    if not path.exists():
        return None
    data = ckpt.read_json(path)
    path.unlink()
    return data if isinstance(data, dict) else None


def _trial_id(directory: Path) -> int | None:
    """The Determined trial id its progress pickle recorded, if any."""
    for name in ("trial_state.pkl", "workload_sequencer.pkl"):
        if (directory / name).is_file():
            state = load_pickle(directory / name)
            if isinstance(state, dict) and isinstance(state.get("trial_id"), int):
                return int(state["trial_id"])
    return None


def _local_copy(s3: Any, source: str, dest: Path) -> Path:
    if source.startswith("s3://"):
        dest.mkdir(parents=True)
        download_prefix(s3, parse_location(source.rstrip("/")), dest)
        return dest
    path = Path(source).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{source}: not a directory (give a checkpoint directory or s3://)")
    return path


def _register(
    client: MlflowClient,
    s3: Any,
    runs: ExperimentRuns,
    path: Path,
    artifacts_destination: str | None,
) -> ImportedCheckpoint:
    metadata = ckpt.read_json(path / ckpt.METADATA_FILE)
    load_data = ckpt.read_json(path / ckpt.LOAD_DATA_FILE)
    trial_id = f"determined-{metadata['trial_id']}"
    run_id = runs.trial_run(
        trial_id, load_data.get("hparams") or {}, {"det.imported_from": "determined"}
    )
    uuid = path.name
    location = run_checkpoint_location(client, run_id, artifacts_destination, uuid)
    upload_dir(s3, path, location, last=ckpt.METADATA_FILE)
    uri = f"runs:/{run_id}/checkpoints/{uuid}"
    record = {
        "uuid": uuid,
        "uri": uri,
        "s3_uri": location.uri,
        "steps_completed": metadata.get("steps_completed"),
        "validation_metrics": None,
        "bytes": sum(f["size"] for f in (metadata.get("files") or {}).values()),
    }
    record_checkpoint(client, run_id, record)
    return ImportedCheckpoint(
        source=str(path),
        uuid=uuid,
        uri=uri,
        trial_id=trial_id,
        run_id=run_id,
        steps_completed=int(metadata.get("steps_completed") or 0),
        trial_cls_spec=str(load_data["trial_cls_spec"]),
    )
