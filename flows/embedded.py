"""The no-server default: with no MLFLOW_TRACKING_URI, a local MLflow SQLite store and
artifact directory in the installation's folder (det_tasks.home); with no PREFECT_API_URL,
Prefect's own ephemeral server. Variables the user set always win, so the same entry points
run against a real stack unchanged.

``EmbeddedPrefectServer`` starts that same server app (Prefect's ephemeral mode: UI off, only
the services an ephemeral server runs) before this process imports Prefect, so the two
start-ups overlap; see its docstring."""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from cluster.environment import accepts
from det_tasks.config import ExperimentConfig
from det_tasks.config.storage_paths import check_checkpoint_storage, local_checkpoint_root
from det_tasks.home import (
    RECORDING_SETTINGS,
    det_tasks_home,
    no_server_recording,
    warm_record,
)
from registry.servers.database_templates import PREFECT_TEMPLATE
from registry.servers.shared_database import create_once

__all__ = [
    "PRESTART_ENV",
    "WARM_SERVICES_ENV",
    "EmbeddedPrefectServer",
    "WarmServices",
    "attach_warm_services",
    "honour_checkpoint_folder",
    "prefect_database_ready",
    "start_shielded_prefect_server",
    "use_embedded_defaults",
]


def use_embedded_defaults() -> dict[str, str]:
    """Fill in what is unset for a run without servers; returns what was set, so the caller
    can tell the user where to look."""
    chosen: dict[str, str] = {}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        home = det_tasks_home()
        home.mkdir(parents=True, exist_ok=True)
        defaults = no_server_recording(home)
        chosen["MLFLOW_TRACKING_URI"] = defaults["MLFLOW_TRACKING_URI"]
        if not os.environ.get("DET_TASKS_ARTIFACT_ROOT"):
            chosen["DET_TASKS_ARTIFACT_ROOT"] = defaults["DET_TASKS_ARTIFACT_ROOT"]
    if not os.environ.get("PREFECT_API_URL"):
        # The ephemeral server otherwise logs an error per start when it cannot phone home.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for name, value in chosen.items():
        os.environ[name] = value
    return chosen


def honour_checkpoint_folder(cfg: ExperimentConfig) -> str | None:
    """Keep a run's checkpoints where the config's ``checkpoint_storage`` folder says
    (``host_path`` [+ ``storage_path``] of ``shared_fs``, ``container_path`` of
    ``directory``), as ``det-tasks run`` does, when the run records without servers: the
    folder becomes this process's artifact root, so the experiments it creates keep their
    runs' artifacts there (``<folder>/<experiment>/<run id>/artifacts/checkpoints/<uuid>``;
    workers write to a run's own artifact location, warm ones included). Returns the one
    line that says where checkpoints go, or None for a config without such a folder.

    Callable before or after ``use_embedded_defaults`` / ``attach_warm_services``: a value
    equal to the home's embedded default (``no_server_recording``) is not the user's. A
    setting the user made wins (an MLflow store of their own: its artifacts; their
    DET_TASKS_ARTIFACT_ROOT), and the line then says the field is not used and why. An
    experiment created before keeps the folder it was created with (MLflow fixes it). A
    folder that cannot be written is a ConfigError, as under ``det-tasks run``."""
    found = local_checkpoint_root(cfg)
    if found is None:
        return None
    field, folder = found
    defaults = no_server_recording(det_tasks_home())
    tracking = os.environ.get("MLFLOW_TRACKING_URI")
    if tracking and tracking != defaults["MLFLOW_TRACKING_URI"]:
        return (
            f"`{field}` = {folder} is not used: MLFLOW_TRACKING_URI={tracking} is set, so "
            "checkpoints go to that MLflow's artifact store (det, the MLflow UI and "
            "load_trial_from_checkpoint_path read them there)"
        )
    chosen = os.environ.get("DET_TASKS_ARTIFACT_ROOT") or defaults["DET_TASKS_ARTIFACT_ROOT"]
    own = chosen != defaults["DET_TASKS_ARTIFACT_ROOT"]
    if own and Path(chosen).expanduser().resolve() != folder:
        return (
            f"`{field}` = {folder} is not used: DET_TASKS_ARTIFACT_ROOT={chosen} is set, so "
            "checkpoints go under it; unset it to keep them in the config's folder"
        )
    check_checkpoint_storage(cfg, "checkpoint_storage")  # writable, as det-tasks run checks
    os.environ["DET_TASKS_ARTIFACT_ROOT"] = str(folder)
    return (
        f"checkpoints go under {folder} (`{field}`), as "
        "<experiment>/<run id>/artifacts/checkpoints/<uuid>; an experiment created before "
        "keeps its own folder"
    )


# What a run takes from the warm services' record (infra.warm_home): where its flow and
# trials run. The run's own recording settings must equal those its workers were given;
# the ones the embedded mode would choose itself (no_server_recording) may be left unset.
_WARM_ADDRESSES = ("PREFECT_API_URL", "DET_TASKS_DASK_SCHEDULER")
WARM_SERVICES_ENV = "DET_TASKS_WARM_SERVICES"  # "0": never use them
# Sizes the embedded cluster's workers; set, the user wants that cluster, not warm workers.
_EMBEDDED_SIZING = "DET_TASKS_WORKER_MEMORY_MB"


@dataclasses.dataclass(frozen=True)
class WarmServices:
    """The home's warm services a run was pointed at, for what it tells the user."""

    prefect_api: str
    scheduler: str
    tracking_uri: str
    workers: int


def attach_warm_services(slots_per_trial: int = 1) -> WarmServices | None:
    """Point this run at the home's warm Prefect server and Dask cluster
    (``python -m infra.warm_home start``) when they answer and the run would record where
    their workers do; returns them, or None (the run starts its own, as without).

    Never where the user chose otherwise: ``DET_TASKS_WARM_SERVICES=0``, a Prefect server or
    Dask scheduler of their own (environment, profile or project settings), a recording
    setting (``RECORDING_SETTINGS``: MLflow store, artifact root, S3) other than the warm
    workers', or the embedded workers' size; nor where a trial needs more GPUs than one
    warm worker owns. Must run before this process imports Prefect, which reads its
    settings once."""
    if os.environ.get(WARM_SERVICES_ENV) == "0" or os.environ.get(_EMBEDDED_SIZING):
        return None
    if _prefect_configured_elsewhere() or os.environ.get("DET_TASKS_DASK_SCHEDULER"):
        return None
    recorded = warm_record()
    if not all(name in recorded for name in _WARM_ADDRESSES + RECORDING_SETTINGS):
        return None
    embedded_choices = no_server_recording(det_tasks_home())
    for name in RECORDING_SETTINGS:
        unset = recorded[name] if name in embedded_choices else ""
        if os.environ.get(name, unset) != recorded[name]:
            return None
    gpus_per_worker = str(recorded.get("gpus_per_worker", "0"))
    if gpus_per_worker.isdigit() and 0 < int(gpus_per_worker) < slots_per_trial:
        return None
    if not _healthy(recorded["PREFECT_API_URL"]) or not accepts(
        recorded["DET_TASKS_DASK_SCHEDULER"]
    ):
        return None
    os.environ.update({name: recorded[name] for name in (*_WARM_ADDRESSES, *embedded_choices)})
    workers = str(recorded.get("workers", ""))
    return WarmServices(
        prefect_api=recorded["PREFECT_API_URL"],
        scheduler=recorded["DET_TASKS_DASK_SCHEDULER"],
        tracking_uri=recorded["MLFLOW_TRACKING_URI"],
        workers=int(workers) if workers.isdigit() else 0,
    )


def start_shielded_prefect_server() -> None:
    """Start Prefect's ephemeral server now, with SIGINT and SIGHUP blocked while it is
    spawned: the child keeps that mask, so a terminal's Ctrl-C or its closing (sent to the
    whole foreground process group) stops the experiment gracefully instead of killing the API
    the flow still needs to record its stop. The flow's own process unblocks at once and
    reuses this server (Prefect keeps one per process), and stops it by SIGTERM at exit.
    No-op with PREFECT_API_URL set."""
    if os.environ.get("PREFECT_API_URL"):
        return
    database = _prefect_sqlite_database()
    if database is None:
        _start_ephemeral_server()
    else:  # the first start in a fresh home creates the schema; others wait for it
        create_once(database, _start_ephemeral_server, PREFECT_TEMPLATE)
        _start_ephemeral_server()  # no-op when create_once just started it


def _start_ephemeral_server() -> None:
    from prefect.client.orchestration import get_client

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP})
    try:
        with get_client(sync_client=True) as client:
            client.api_healthcheck()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _prefect_sqlite_database() -> Path | None:
    """The SQLite file the ephemeral server will use, or None for another database."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    text = url.get_secret_value() if url is not None else ""
    if not text.startswith("sqlite"):
        return None
    return Path(text.split(":///", 1)[1]).expanduser()


PRESTART_ENV = "DET_TASKS_PREFECT_PRESTART"  # "0": let Prefect start its server itself
# Prefect's own start-up wait (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS) defaults to
# 20 s, too short on a busy machine.
READY_TIMEOUT_S = 300.0
PORT_IN_USE = 3  # uvicorn's exit code when its port was taken between our probe and its bind


class EmbeddedPrefectServer:
    """Prefect's ephemeral server, started from ``python -m flows.experiment`` before the
    heavy imports, as its own process; the caller waits for it (``wait_ready``) only
    before the flow starts.

    Why not let Prefect start it: Prefect starts its ephemeral server at the first API
    call, after this process has imported torch, MLflow and Dask and Prefect's server
    modules (~4.5 s), and the server then imports the same modules again (~3 s) while the
    flow waits. Started first, the two overlap. It is the same server Prefect would start
    (the same uvicorn command and ``PREFECT__SERVER_EPHEMERAL`` app, UI off), with the same
    Ctrl-C shield (SIGINT blocked in it, as start_shielded_prefect_server does) and the same
    end (stopped at this process's exit, after Prefect's own exit handlers have flushed
    their logs and events). The first start in a fresh Prefect home creates its database
    under create_once's lock, in a thread, so imports still overlap it.

    ``start()`` returns None (Prefect then starts its own, as before) where the user's
    settings might choose another server: PREFECT_API_URL or ephemeral-mode settings in the
    environment or the active profile, a ``prefect.toml``, a ``.env`` naming PREFECT_
    settings or a ``pyproject.toml`` with ``[tool.prefect]`` in the working directory; or
    with ``DET_TASKS_PREFECT_PRESTART=0``."""

    def __init__(self, port: int, database: Path | None) -> None:
        self.port = port
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.database = database
        self.process: subprocess.Popen[bytes] | None = None
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="det-tasks-prefect-server")

    @classmethod
    def start(cls) -> EmbeddedPrefectServer | None:
        if os.environ.get(PRESTART_ENV) == "0" or _prefect_configured_elsewhere():
            return None
        server = cls(_free_port(), _default_sqlite_database())
        # Set before this process imports prefect, which reads its settings once, at import.
        os.environ["PREFECT_API_URL"] = server.api_url
        atexit.register(server.stop)
        server._thread.start()
        return server

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once the server answers its health check; raise if it cannot start."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the embedded Prefect server ({self.api_url}) did not answer within "
                f"{timeout_s:.0f} s"
            )
        if self.error is not None:
            raise RuntimeError(f"the embedded Prefect server failed: {self.error}") from None

    def stop(self) -> None:
        self._stopping.set()  # a server not spawned yet never is
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _run(self) -> None:
        try:
            if self.database is None:
                self._spawn_and_wait()
            else:  # the first start in a fresh home creates the schema; others wait for it
                create_once(self.database, self._spawn_and_wait, PREFECT_TEMPLATE)
                if self.process is None:
                    self._spawn_and_wait()
        except BaseException as err:
            self.error = err

    def _spawn_and_wait(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        if self._stopping.is_set():
            return
        self.process = self._spawn()
        while time.monotonic() < deadline and not self._stopping.is_set():
            code = self.process.poll()
            if code == PORT_IN_USE:
                self.port = _free_port()  # the flow's URL must follow it
                self.api_url = f"http://127.0.0.1:{self.port}/api"
                os.environ["PREFECT_API_URL"] = self.api_url
                self.process = self._spawn()
                continue
            if code is not None:
                raise RuntimeError(f"it exited with code {code} (its log is above)")
            if _healthy(self.api_url):
                return
            time.sleep(0.1)
        raise TimeoutError(f"no answer from {self.api_url} in {READY_TIMEOUT_S:.0f} s")

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Prefect's SubprocessASGIServer command, in a session of its own: a terminal's
        Ctrl-C and the SIGTERM that ``timeout``, systemd or ``kill -- -PGID`` send to the
        flow's process group must not kill the API the flow needs to record its stop. It
        watches the pipe on its standard input and stops (SIGTERM to itself: uvicorn's
        graceful end) when that closes, so it ends with this process however this one
        ends, SIGKILL included."""
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        # It otherwise logs an error per start when it cannot phone home.
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        env.pop("PREFECT_API_URL", None)
        command = [sys.executable, "-c", _UVICORN_ENDING_WITH_PARENT]
        command += ["--app-dir", _site_packages(), "--factory"]
        command += ["prefect.server.api.server:create_app", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        return subprocess.Popen(command, env=env, stdin=subprocess.PIPE, start_new_session=True)


# ``python -m uvicorn ARGS`` that also ends itself gracefully once its standard input closes
# (the parent's end of the pipe: closed by the kernel when the parent dies, however it dies).
_UVICORN_ENDING_WITH_PARENT = (
    "import os, runpy, signal, sys, threading\n"
    "def watch():\n"
    "    sys.stdin.buffer.read()\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "sys.argv = ['uvicorn', *sys.argv[1:]]\n"
    "runpy.run_module('uvicorn', run_name='__main__', alter_sys=True)\n"
)


def _site_packages() -> str:
    """Where prefect is installed (uvicorn's --app-dir, as Prefect passes it, so a module
    in the working directory cannot shadow it), found without importing prefect."""
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None, "prefect is not installed"
    return str(Path(spec.origin).parent.parent)


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def prefect_database_ready() -> bool:
    """Whether Prefect's server would create nothing in this home: its SQLite database was
    made ready by an earlier run (create_once's marker beside it)."""
    database = _default_sqlite_database()
    return database is not None and database.with_name(database.name + ".ready").exists()


def _prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def _default_sqlite_database() -> Path | None:
    """The SQLite file Prefect's server will use by default (the create_once lock and
    marker sit beside it), or None when the environment names another database."""
    for name in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        if url := os.environ.get(name):
            if not url.startswith("sqlite") or ":///" not in url:
                return None
            return Path(url.split(":///", 1)[1]).expanduser()
    return _prefect_home() / "prefect.db"


def _prefect_configured_elsewhere() -> bool:
    """Whether settings this module does not read could choose the server (see
    EmbeddedPrefectServer); then Prefect resolves them itself, as before."""
    chosen = ("PREFECT_API_URL", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "PREFECT_SERVER_EPHEMERAL")
    if any(name.startswith(chosen) for name in os.environ):
        return True
    cwd = Path.cwd()
    if (cwd / "prefect.toml").exists():
        return True
    if _mentions(cwd / ".env", "PREFECT_") or _mentions(cwd / "pyproject.toml", "tool.prefect"):
        return True
    return any(name.startswith(chosen) for name in _active_profile())


def _mentions(path: Path, text: str) -> bool:
    try:
        return text in path.read_text(errors="replace")
    except OSError:
        return False


def _active_profile() -> dict[str, object]:
    path = Path(
        os.environ.get("PREFECT_PROFILES_PATH") or _prefect_home() / "profiles.toml"
    ).expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    name = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    table = profiles.get("profiles", {}).get(name, {})
    return table if isinstance(table, dict) else {}
