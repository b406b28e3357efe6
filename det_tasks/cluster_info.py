"""What a launched trial script learns about its run: ``det.get_cluster_info()``.

The runner (or a flow task) writes a small JSON file and points ``DET_TASKS_CLUSTER_INFO``
at it; scripts written for Determined read hparams, config and the checkpoint to resume
from exactly as they did on a Determined cluster. Locally, with nothing launched, the
answer is None, as Determined's was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["ENV_VAR", "ClusterInfo", "TrialInfo", "get_cluster_info", "launched"]

ENV_VAR = "DET_TASKS_CLUSTER_INFO"


@dataclasses.dataclass(frozen=True)
class TrialInfo:
    trial_id: int | str
    experiment_id: int | str
    hparams: dict[str, Any]
    config: dict[str, Any]
    trial_seed: int

    @property
    def _config(self) -> dict[str, Any]:
        """Determined's private spelling, which user code reaches for."""
        return self.config


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    trial: TrialInfo
    latest_checkpoint: str | None
    checkpoint_dir: str
    model_dir: str | None = None
    # How long the searcher wants this trial trained ({"batches": N} or {"epochs": N}):
    # it overrides the script's own fit(max_length=...), as Determined's searcher did on a
    # cluster. None: the script decides. test_mode: `det-tasks run --test`.
    searcher_length: dict[str, int] | None = None
    test_mode: bool = False
    # The experiment's best searcher metric so far, when a search passes it on (a flow's
    # segment): what core_context.train.get_experiment_best_validation() starts from.
    experiment_best: float | None = None

    # Determined's ClusterInfo fields that scripts read, as they are for a trial here.
    @property
    def task_type(self) -> str:
        return "TRIAL"

    @property
    def container_rank(self) -> int:
        """This process's node in a multi-node trial (torchrun's group rank); 0 on one."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("HOROVOD_CROSS_RANK", "0")))

    @property
    def slot_ids(self) -> list[int]:
        """The GPUs this trial's node was given (CUDA_VISIBLE_DEVICES); [] on CPU."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return [int(v) for v in visible.split(",") if v.strip().isdigit()]

    @property
    def task_id(self) -> str:
        return f"{self.trial.experiment_id}.{self.trial.trial_id}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        data = json.loads(text)
        return cls(trial=TrialInfo(**data.pop("trial")), **data)


def get_cluster_info() -> ClusterInfo | None:
    """This run's info when launched by det_tasks; None for plain local runs."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return ClusterInfo.from_json(f.read())


@contextlib.contextmanager
def launched(info: ClusterInfo) -> Iterator[None]:
    """Expose ``info`` to code run inside the block (and to its child processes)."""
    fd, path = tempfile.mkstemp(prefix="det-tasks-info-", suffix=".json")
    previous = os.environ.get(ENV_VAR)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(info.to_json())
        os.environ[ENV_VAR] = path
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
        os.unlink(path)
