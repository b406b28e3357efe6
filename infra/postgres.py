"""A local PostgreSQL server for MLflow's and Prefect's databases (the "at scale" backend of
DESIGN.md), from the PostgreSQL binaries on the machine. Bound to 127.0.0.1 with password
authentication; the password is generated once and kept (mode 0600) under the stack root.
PostgreSQL refuses to run as root, so under root it runs as the ``postgres`` user, with its
data directory where that user can reach it (``/tmp/det-tasks-postgres-<hash of root>``
when the stack root's parents are private, as pytest's temporary folders are).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from infra.services import Service, ServiceError, kept_secrets, port_open

__all__ = ["DATABASES", "database_sizes", "postgres_service", "postgres_urls"]

DATABASES = ("mlflow", "prefect")
USER = "det_tasks"


def _bin(name: str) -> str:
    for candidate in (
        shutil.which(name),
        *sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}")),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ServiceError(
        f"PostgreSQL's `{name}` is not installed: install the PostgreSQL server binaries "
        "(e.g. apt install postgresql) or leave DET_TASKS_POSTGRES_PORT unset for SQLite"
    )


def _as_postgres_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _password(root: Path) -> str:
    kept = kept_secrets(
        root / "postgres-password.json", lambda: {"password": secrets.token_urlsafe(24)}
    )
    return str(kept["password"])


def _reachable_by_others(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents] if p.exists())


def data_dir(root: Path) -> Path:
    home = root / "postgres"
    if os.geteuid() == 0 and not _reachable_by_others(root):
        digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
        home = Path(tempfile.gettempdir()) / f"det-tasks-postgres-{digest}"
    return home / "data"


def _initdb(root: Path) -> Path:
    data = data_dir(root)
    if (data / "PG_VERSION").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    pwfile = data.parent / "pwfile"
    pwfile.write_text(_password(root) + "\n")
    if os.geteuid() == 0:
        shutil.chown(data.parent, "postgres", "postgres")
        shutil.chown(data, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    argv = [
        *_as_postgres_user(),
        _bin("initdb"),
        "-D",
        str(data),
        "-U",
        USER,
        "--auth=scram-sha-256",
        f"--pwfile={pwfile}",
        "--encoding=UTF8",
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise ServiceError(f"initdb failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return data


def postgres_service(root: Path, port: int) -> Service:
    data = data_dir(root)
    argv = [
        _bin("postgres"),
        "-D",
        str(data),
        "-p",
        str(port),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        f"unix_socket_directories={data}",
        "-c",
        "max_connections=400",
    ]
    return Service(
        "postgres",
        argv,
        lambda: port_open(port, timeout=1),
        root,
        start_timeout_s=60,
        # SIGINT is PostgreSQL's "fast" shutdown (pg_ctl's default): it ends any client
        # session still open and writes its shutdown checkpoint. SIGTERM's "smart" one waits
        # for every client to leave first, and one that never does held the stop until KILL.
        stop_signal=signal.SIGINT,
        # The server itself, switched to its user (not under runuser, which slept 2 s on
        # every stop and then SIGKILLed the server whether or not its checkpoint was done).
        user="postgres" if os.geteuid() == 0 else None,
        cwd=data,  # one that user can enter (PostgreSQL looks up its working directory)
    )


def prepare(root: Path) -> None:
    """Create the data directory once (before the first start)."""
    _initdb(root)


def _connect(root: Path, port: int) -> Any:
    import psycopg2

    return psycopg2.connect(
        host="127.0.0.1", port=port, user=USER, password=_password(root), dbname="postgres"
    )


def create_databases(root: Path, port: int) -> None:
    """The ``mlflow`` and ``prefect`` databases, created if missing."""
    conn = _connect(root, port)
    conn.autocommit = True
    with conn.cursor() as cur:
        for name in DATABASES:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()


def database_sizes(root: Path, port: int) -> dict[str, int]:
    """Bytes PostgreSQL holds for each of ``DATABASES`` (``pg_database_size``): how a
    capacity plan reads the stack's growth."""
    conn = _connect(root, port)
    try:
        with conn.cursor() as cur:
            sizes = {}
            for name in DATABASES:
                cur.execute("SELECT pg_database_size(%s)", (name,))
                sizes[name] = int(cur.fetchone()[0])
    finally:
        conn.close()
    return sizes


def postgres_urls(root: Path, port: int) -> dict[str, str]:
    """SQLAlchemy URLs of the two databases: MLflow's (psycopg2) and Prefect's (asyncpg)."""
    auth = f"{USER}:{_password(root)}@127.0.0.1:{port}"
    return {
        "mlflow": f"postgresql+psycopg2://{auth}/mlflow",
        "prefect": f"postgresql+asyncpg://{auth}/prefect",
    }
