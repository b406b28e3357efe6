"""What each Dask worker job asks Slurm for, and how many may run: the settings of
``cluster.slurm_workers`` (``DET_TASKS_SLURM_WORKERS``, JSON). No Dask import: the stack
checks them before it starts a scheduler with them."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from cluster.pools import DEFAULT_POOL
from cluster.worker_spec import WorkerSpec

__all__ = ["JOB_NAME_PREFIX", "SETTINGS_ENV", "SLURM_WORKERS_NAME", "SlurmWorkerSettings"]

SETTINGS_ENV = "DET_TASKS_SLURM_WORKERS"
JOB_NAME_PREFIX = "det-worker"
SLURM_WORKERS_NAME = "det-tasks-slurm-workers"  # the scheduler plugin's name


@dataclasses.dataclass(frozen=True)
class SlurmWorkerSettings:
    """What each worker job asks Slurm for and how many may run. ``sbatch_args`` are
    Determined's ``slurm.sbatch_args``: passed to ``sbatch`` as they are. ``env``: the
    client variables (MLflow, S3) every worker needs, exported in the job script."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    walltime: str = "24:00:00"
    cores: int = 1
    memory: str = "4GB"
    gpus: int = 0
    gpu_type: str | None = None
    sbatch_args: tuple[str, ...] = ()
    max_jobs: int = 8
    idle_after_s: float = 60.0
    # Slurm's warning before a job's time limit (SIGUSR1): the held trial checkpoints
    # where it stands and gives its slot back, then the worker closes (cluster.slurm_warning).
    warning_s: int = 120
    pool: str = DEFAULT_POOL
    python: str = sys.executable
    local_directory: str = "/tmp"
    output_dir: str | None = None
    slurm_conf: str | None = None  # the site's slurm.conf, where it is not the default
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> SlurmWorkerSettings:
        """The settings, or ValueError naming what is wrong (not JSON, not a mapping, an
        unknown setting, a count that is not a positive whole number)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{SETTINGS_ENV} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{SETTINGS_ENV} must be a JSON object, got {text[:80]!r}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ValueError(
                f"{SETTINGS_ENV}: unknown setting(s) {sorted(unknown)}; known: {known}"
            )
        for name in ("cores", "max_jobs", "warning_s"):
            value = data.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{SETTINGS_ENV}: {name} must be a whole number >= 1, got {value!r}"
                )
        data["sbatch_args"] = tuple(data.get("sbatch_args", ()))
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def directives(self) -> list[str]:
        """``#SBATCH`` options beyond dask-jobqueue's own (name, partition, CPUs, memory,
        time): account, QoS, GPUs, the warning signal, output, the site's own."""
        extra = [f"--signal=B:USR1@{self.warning_s}"]
        if self.account:
            extra.append(f"--account={self.account}")
        if self.qos:
            extra.append(f"--qos={self.qos}")
        if self.gpus:
            kind = f"{self.gpu_type}:" if self.gpu_type else ""
            extra.append(f"--gres=gpu:{kind}{self.gpus}")
        if self.output_dir:
            extra.append(f"--output={self.output_dir}/{JOB_NAME_PREFIX}-%j.log")
        return extra + list(self.sbatch_args)

    def for_experiment(self, slurm: dict[str, Any] | None) -> SlurmWorkerSettings:
        """These settings with an experiment's ``slurm:`` section over them: its
        ``slots_per_node`` are GPUs per job where jobs get GPUs (the site's ``gpus``, or a
        ``gpu_type``), else CPUs; its ``sbatch_args`` follow the site's."""
        if not slurm:
            return self
        gpu_type = slurm.get("gpu_type") or self.gpu_type
        slots = slurm.get("slots_per_node")
        gpus, cores = self.gpus, self.cores
        if self.gpus or slurm.get("gpu_type"):
            gpus = slots or max(self.gpus, 1)
        elif slots:
            cores = slots
        return dataclasses.replace(
            self, gpus=gpus, cores=cores, gpu_type=gpu_type,
            sbatch_args=(*self.sbatch_args, *slurm.get("sbatch_args", ())),
        )  # fmt: skip

    def worker_spec(self) -> WorkerSpec:
        gpus = tuple(range(self.gpus)) if self.gpus else None
        return WorkerSpec(
            threads=self.cores, gpus=gpus, pool=self.pool, preload=("cluster.held_trials",)
        )
