"""Which code an experiment runs when it starts or resumes, and what to tell the user.

- A new experiment snapshots its model folder (registry.experiments.code_snapshot) and runs that.
- A resumed one (``--activate``, a suspended deployment run resumed by ``det experiment
  activate``) runs the snapshot it recorded. If the folder on disk differs, one line says
  so, with the files, and how to run the folder's code instead: ``--use-changed-code``,
  which takes a new snapshot and records it as the experiment's next code version.
- An experiment submitted as a package (``det experiment create``) runs that package, its
  snapshot already.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from registry.experiments.code_snapshot import (
    SNAPSHOT_TAG,
    CodeSnapshot,
    changed_files,
    describe_changes,
    open_snapshot,
    record_snapshot,
    take_snapshot,
)
from registry.experiments.view import find_parent

__all__ = [
    "USE_CHANGED_CODE",
    "ExperimentCode",
    "adopt_code",
    "code_for_start",
    "code_verdict",
    "package_code",
]

USE_CHANGED_CODE = "--use-changed-code"


@dataclasses.dataclass(frozen=True)
class ExperimentCode:
    """The code this start runs (``snapshot``), the one the experiment had recorded
    (``recorded``: None for a new experiment), how the folder on disk differs from the
    recorded one, and the line to tell the user (None: nothing worth a line)."""

    snapshot: CodeSnapshot
    recorded: CodeSnapshot | None
    differences: list[str]
    note: str | None

    @property
    def changed(self) -> bool:
        """Whether this start runs other code than the experiment recorded."""
        return self.recorded is not None and self.recorded.version != self.snapshot.version


def code_for_start(
    client: Any,
    run_key: str,
    model_dir: Path,
    excluded_dirs: Sequence[Path],
    use_changed_code: bool,
) -> ExperimentCode:
    """The code experiment ``run_key`` runs now, from its model folder ``model_dir``."""
    found = find_parent(client, run_key)
    uri = found[0].data.tags.get(SNAPSHOT_TAG) if found else None
    short = run_key[:8]
    if uri is None:
        snapshot = take_snapshot(model_dir, excluded_dirs)
        note = None
        if found is not None:  # created before experiments kept a snapshot
            note = (
                f"experiment {short} has no code snapshot (it was created before they were "
                f"kept): it resumes with the code of {model_dir} as it is now, snapshot "
                f"{snapshot.version}"
            )
        return ExperimentCode(snapshot, None, [], note)
    recorded = open_snapshot(uri)
    differences = changed_files(recorded, model_dir, excluded_dirs)
    if not differences:
        return ExperimentCode(recorded, recorded, [], None)
    files = describe_changes(differences)
    if use_changed_code:
        snapshot = take_snapshot(model_dir, excluded_dirs)
        note = (
            f"experiment {short} resumes with the changed code of {model_dir} ({files}), as "
            f"{USE_CHANGED_CODE} asks: code version {snapshot.version} (was "
            f"{recorded.version}), recorded in MLflow as det.code_version"
        )
        return ExperimentCode(snapshot, recorded, differences, note)
    note = (
        f"{model_dir} differs from experiment {short}'s code snapshot {recorded.version} "
        f"({files}): it resumes with the snapshot, as Determined does; to run the changed "
        f"code instead, activate with {USE_CHANGED_CODE}"
    )
    return ExperimentCode(recorded, recorded, differences, note)


def package_code(package: str, model_dir: Path) -> ExperimentCode:
    """The code of an experiment submitted as a package, unpacked into ``model_dir``."""
    from registry.experiments.code_snapshot import code_version

    snapshot = CodeSnapshot(package, model_dir, code_version(model_dir), None)
    return ExperimentCode(snapshot, snapshot, [], None)  # a flow run keeps its package


def adopt_code(client: Any, parent_run_id: str, code: ExperimentCode) -> None:
    """Record the code this start runs on the parent run; a change of code on every trial
    run too (their ``det.code_version`` is then the new one, ``det.code_versions`` the
    history)."""
    from registry.experiments.view import trial_runs_of

    parent = client.get_run(parent_run_id)
    if not code.changed and parent.data.tags.get(SNAPSHOT_TAG) == code.snapshot.uri:
        return
    runs = [parent_run_id]
    if code.changed:
        runs += [run.info.run_id for run in trial_runs_of(client, parent)]
    record_snapshot(client, runs, code.snapshot)


def code_verdict(code: ExperimentCode) -> str:
    """For a failed activation: whether the experiment's code changed since it was paused
    (instead of guessing at hyperparameters)."""
    recorded = code.recorded
    if recorded is None:
        return "the experiment had no code snapshot to compare with"
    if code.changed:
        return (
            f"the experiment's code changed since it was paused: this activation ran the "
            f"folder's code {code.snapshot.version} ({describe_changes(code.differences)}) "
            f"instead of its snapshot {recorded.version}; undo the change, or activate "
            f"without {USE_CHANGED_CODE} to resume with the snapshot"
        )
    unused = (
        f"; the folder's edits ({describe_changes(code.differences)}) were not used"
        if code.differences
        else ""
    )
    return (
        f"the experiment's code did not change since it was paused (it ran its snapshot "
        f"{recorded.version}{unused}): look at what the config or its overrides give the "
        "model (hyperparameters that shape it)"
    )
