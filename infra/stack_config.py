"""Where the local stack's services listen and keep their state (``StackConfig``), read from
``DET_TASKS_*`` variables; the bucket every stack has. No service is started here."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from infra.postgres import postgres_urls

__all__ = ["ARTIFACTS_PREFIX", "BUCKET", "StackConfig"]

BUCKET = "det-tasks"
ARTIFACTS_PREFIX = "mlflow-artifacts"


def _port(name: str, default: int) -> int:
    return int(os.environ.get(f"DET_TASKS_{name}_PORT", default))


@dataclasses.dataclass(frozen=True)
class StackConfig:
    root: Path
    s3_port: int = 8333
    master_port: int = 9334
    volume_port: int = 8081
    filer_port: int = 8889
    mlflow_port: int = 5001
    backend_store_uri: str | None = None
    prefect_port: int = 4200
    project_dir: Path = Path(__file__).resolve().parents[1]
    # Require credentials on MLflow (basic-auth app) and Prefect (API auth string) too, for
    # a stack exposed beyond loopback; DET_TASKS_STACK_AUTH=1 for `make up`.
    auth: bool = False
    # PostgreSQL behind MLflow and Prefect instead of SQLite (infra/postgres.py), on this
    # port; DET_TASKS_POSTGRES_PORT for `make up`.
    postgres_port: int | None = None
    # The Dask scheduler experiment flows run trials through (infra/dask_cluster.py); its workers
    # (DET_TASKS_DASK_WORKERS, default 2) start with the stack.
    dask_port: int = 8786
    # SeaweedFS's gRPC ports are its HTTP ports plus this. Keep them below the kernel's
    # ephemeral range (32768-60999 on Linux): a port there can be held by any outgoing
    # connection's source port, and SeaweedFS then dies with "bind: address already in use".
    seaweed_grpc_shift: int = 10000
    # The address every service binds to and that clients are given: loopback by default;
    # an address other hosts reach for a stack they share (infra/hosts.py: a bridge's).
    host: str = "127.0.0.1"
    # Dask workers started with the stack on this host; None: DET_TASKS_DASK_WORKERS
    # (default 2). 0 when the workers run on other hosts.
    dask_workers: int | None = None
    # Dask workers as Slurm jobs (cluster/slurm_workers.py): their settings as JSON
    # (``SlurmWorkerSettings``), DET_TASKS_SLURM_WORKERS; None: no Slurm.
    slurm_workers: str | None = None

    @classmethod
    def from_env(cls) -> StackConfig:
        root = Path(os.environ.get("DET_TASKS_STACK_DIR", ".stack")).resolve()
        return cls(
            root=root,
            s3_port=_port("S3", 8333),
            master_port=_port("SEAWEED_MASTER", 9334),
            volume_port=_port("SEAWEED_VOLUME", 8081),
            filer_port=_port("SEAWEED_FILER", 8889),
            mlflow_port=_port("MLFLOW", 5001),
            backend_store_uri=os.environ.get("DET_TASKS_MLFLOW_BACKEND_URI"),
            prefect_port=_port("PREFECT", 4200),
            dask_port=_port("DASK", 8786),
            seaweed_grpc_shift=int(os.environ.get("DET_TASKS_SEAWEED_GRPC_SHIFT", 10000)),
            host=os.environ.get("DET_TASKS_STACK_HOST") or "127.0.0.1",
            auth=os.environ.get("DET_TASKS_STACK_AUTH", "") in ("1", "true", "yes"),
            slurm_workers=os.environ.get("DET_TASKS_SLURM_WORKERS") or None,
            # With workers as Slurm jobs the stack starts none of its own unless told to.
            dask_workers=0
            if os.environ.get("DET_TASKS_SLURM_WORKERS")
            and not os.environ.get("DET_TASKS_DASK_WORKERS")
            else None,
            postgres_port=int(os.environ["DET_TASKS_POSTGRES_PORT"])
            if os.environ.get("DET_TASKS_POSTGRES_PORT")
            else None,
        )

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def prefect_api(self) -> str:
        return f"http://{self.host}:{self.prefect_port}/api"

    @property
    def backend_uri(self) -> str:
        if self.postgres_port and not self.backend_store_uri:
            return postgres_urls(self.root, self.postgres_port)["mlflow"]
        return self.backend_store_uri or f"sqlite:///{self.root / 'mlflow' / 'mlflow.db'}"
