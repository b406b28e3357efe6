"""The local stack: SeaweedFS (S3, with access keys: infra.seaweed), an MLflow server
proxying artifacts to it, the Prefect server and worker and the Dask cluster, on loopback (or
the address ``StackConfig.host`` names: infra.hosts). ``python -m infra.stack
up|down|status|env|deploy`` (``make up``, ``make down``, ``make deploy``).

State lives under ``.stack/`` (override with DET_TASKS_STACK_DIR): data, logs, pid files,
generated S3 credentials, and an ``env`` file the tests and users source to reach it (it also
puts this installation's ``det`` and ``det-tasks`` on PATH).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.environment import EXPECTED_WORKERS_ENV as WAIT_WORKERS_ENV
from cluster.slurm_settings import SETTINGS_ENV as SLURM_WORKERS_ENV
from cluster.slurm_settings import SlurmWorkerSettings
from flows.starter_protocol import STARTER_ENV, socket_path
from infra import dask_cluster, deployments, postgres
from infra.postgres import postgres_urls
from infra.seaweed import ensure_bucket, s3_credentials, seaweed_service
from infra.services import (
    Service,
    ServiceError,
    http_ok,
    is_running,
    kept_secrets,
    port_holder,
    start,
    start_all,
    state_lines,
    stop,
    stop_all,
    up_or_down,
)
from infra.stack_config import ARTIFACTS_PREFIX, BUCKET, StackConfig

__all__ = [
    "BUCKET",
    "StackConfig",
    "deploy",
    "deployments_current",
    "down",
    "env_file_text",
    "env_for",
    "main",
    "seaweed_service",
    "service_states",
    "stack_services",
    "up",
]

SCHEDULER_ENV = "DET_TASKS_DASK_SCHEDULER"  # read by cluster.startup

# Seconds an MLflow server worker may leave uvicorn's health ping unanswered (default 5).
MLFLOW_WORKER_HEALTHCHECK_S = 120


def service_auth(config: StackConfig) -> dict[str, str]:
    """The MLflow admin login and the Prefect API auth string of an ``auth`` stack,
    generated once and kept in ``<root>/service-auth.json``."""
    return kept_secrets(
        config.root / "service-auth.json",
        lambda: {
            "mlflow_username": "admin",
            "mlflow_password": secrets.token_urlsafe(24),
            "prefect_auth_string": f"det-tasks:{secrets.token_urlsafe(24)}",
            "flask_secret_key": secrets.token_urlsafe(32),  # MLflow auth app's CSRF key
        },
    )


def _client_auth_env(config: StackConfig) -> dict[str, str]:
    if not config.auth:
        return {}
    auth = service_auth(config)
    return {
        "MLFLOW_TRACKING_USERNAME": auth["mlflow_username"],
        "MLFLOW_TRACKING_PASSWORD": auth["mlflow_password"],
        "PREFECT_API_AUTH_STRING": auth["prefect_auth_string"],
    }


def env_for(config: StackConfig) -> dict[str, str]:
    """What a client needs to reach this stack (also written to ``<root>/env``)."""
    creds = s3_credentials(config)
    return {
        **_client_auth_env(config),
        "MLFLOW_TRACKING_URI": config.mlflow_uri,
        "MLFLOW_S3_ENDPOINT_URL": config.s3_endpoint,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "DET_TASKS_S3_BUCKET": BUCKET,
        "DET_TASKS_MLFLOW_ARTIFACTS": f"s3://{BUCKET}/{ARTIFACTS_PREFIX}",
        "PREFECT_API_URL": config.prefect_api,
        SCHEDULER_ENV: dask_cluster.scheduler_address(config.dask_port, config.host),
        # Workers that Slurm starts on demand: a flow waits for none before it queues.
        **({WAIT_WORKERS_ENV: "0"} if config.slurm_workers else {}),
    }


def _mlflow_auth_config(config: StackConfig) -> Path:
    """The basic-auth app's settings: users in a SQLite file beside the tracking store; a
    logged-in user may read, only the admin may change what it does not own."""
    auth = service_auth(config)
    path = config.root / "mlflow" / "basic_auth.ini"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{config.root / 'mlflow' / 'auth.db'}\n"
        f"admin_username = {auth['mlflow_username']}\n"
        f"admin_password = {auth['mlflow_password']}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    return path


def check_mlflow_loop() -> None:
    """MLflow's server runs on uvloop (mlflow_service): an environment installed before it
    was a dependency lacks it, and the server would die at its start with a traceback in
    its log. Say so before anything starts."""
    if importlib.util.find_spec("uvloop") is None:
        raise ServiceError(
            f"uvloop is not installed in {sys.prefix}, and the stack's MLflow server runs on it: "
            "run `make install` (or `pip install -e '.[platform]'`), then start the stack again"
        )


def mlflow_service(config: StackConfig) -> Service:
    (config.root / "mlflow").mkdir(parents=True, exist_ok=True)
    env = env_for(config)
    argv = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        config.host,
        "--port",
        str(config.mlflow_port),
        "--backend-store-uri",
        config.backend_uri,
        "--artifacts-destination",
        env["DET_TASKS_MLFLOW_ARTIFACTS"],
        "--workers",
        "2",
        # uvicorn's supervisor SIGKILLs a worker that does not answer its ping within 5 s and
        # pings the replacement while it is still importing MLflow: on a 2-core host running
        # 32 trials, the CI's PostgreSQL load test saw one worker killed mid-response
        # (IncompleteRead in the flow) and then a restart loop every 6 s. Hung workers still
        # get replaced, after 2 minutes. uvloop: the sockets uvicorn's workers accept get
        # TCP_NODELAY there; on asyncio they did not (uvicorn binds them with protocol 0, which
        # asyncio's _set_nodelay skips), so each response's body, written after its headers,
        # waited for the client's delayed ACK: ~40 ms on every kept-alive request.
        "--uvicorn-opts",
        f"--loop uvloop --timeout-worker-healthcheck {MLFLOW_WORKER_HEALTHCHECK_S}",
    ]
    if config.auth:
        argv += ["--app-name", "basic-auth"]
    server_env = {
        k: env[k]
        for k in (
            "MLFLOW_S3_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
        )
    }
    # MLflow 3 starts eight huey job consumers (GenAI judges, prompt optimisation) beside the
    # server by default: 1.4 GB of RAM and startup time for features no trial uses.
    server_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    # Nor does it forward the UI's usage telemetry (registry/__init__.py: the clients').
    server_env["MLFLOW_DISABLE_TELEMETRY"] = os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true")
    if config.auth:
        server_env["MLFLOW_AUTH_CONFIG_PATH"] = str(_mlflow_auth_config(config))
        server_env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = service_auth(config)["flask_secret_key"]
    return Service(
        "mlflow",
        argv,
        lambda: http_ok(f"{config.mlflow_uri}/health"),
        config.root,
        env=server_env,
        start_timeout_s=120,
        stop_timeout_s=15,
    )


def _check_ports_free(service: Service, ports: list[int], host: str = "127.0.0.1") -> None:
    if is_running(service):
        return
    for port in ports:
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                raise ServiceError(
                    f"port {port} (for {service.name}) is already in use on {host}"
                    f"{port_holder(port)}; stop what holds it or choose other ports "
                    "(DET_TASKS_S3_PORT, "
                    "DET_TASKS_MLFLOW_PORT, DET_TASKS_PREFECT_PORT, DET_TASKS_DASK_PORT, "
                    "DET_TASKS_SEAWEED_*_PORT)"
                )


def _prefect_env(config: StackConfig) -> dict[str, str]:
    home = config.root / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": config.prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        **(
            {"PREFECT_API_AUTH_STRING": service_auth(config)["prefect_auth_string"]}
            if config.auth
            else {}
        ),
    }


def prefect_server_service(config: StackConfig) -> Service:
    database = (
        os.environ.get("DET_TASKS_PREFECT_DATABASE_URL")
        or (
            postgres_urls(config.root, config.postgres_port)["prefect"]
            if config.postgres_port
            else None
        )
        or (f"sqlite+aiosqlite:///{config.root / 'prefect' / 'prefect.db'}")
    )
    env = {**_prefect_env(config), "PREFECT_API_DATABASE_CONNECTION_URL": database}
    # The UI's own address for the API: Prefect builds it from its default port (4200),
    # not from --port, so on any other port the UI could not reach its server.
    env["PREFECT_SERVER_UI_API_URL"] = config.prefect_api
    if config.auth:
        env["PREFECT_SERVER_API_AUTH_STRING"] = env["PREFECT_API_AUTH_STRING"]
    argv = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        config.host,
        "--port",
        str(config.prefect_port),
    ]
    return Service(
        "prefect-server",
        argv,
        lambda: http_ok(f"{config.prefect_api}/health"),
        config.root,
        env=env,
        start_timeout_s=120,
        stop_timeout_s=15,
        # The server must not think it is a client of itself: neither from the client
        # settings above nor from a shell that points at a server (`source .stack/env`).
        unset=("PREFECT_API_URL",),
    )


def _worker_env(config: StackConfig, workdir: Path | None = None) -> dict[str, str]:
    """What the Prefect worker, and so each flow run it starts, has in its environment."""
    return {
        **_prefect_env(config),
        **env_for(config),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "DET_TASKS_PROJECT_DIR": str(workdir or config.project_dir),
        "DET_TASKS_CACHE_DIR": str((workdir or config.root) / "cache"),
    }


def prefect_worker_service(
    config: StackConfig, pool: str | None = None, workdir: Path | None = None
) -> Service:
    """A process worker on ``pool`` (default: the stack's). With ``workdir`` it runs there,
    in a folder of its own, as a worker on another machine would (no checkout needed).
    The stack's own worker has its flow runs forked by the warm starter
    (``flow_starter_service``); another starts each one cold."""
    pool = pool or POOL
    env = _worker_env(config, workdir)
    if pool == POOL and workdir is None:
        env[STARTER_ENV] = str(socket_path(config.root))
    name = "prefect-worker" if pool == POOL else f"prefect-worker-{pool}"
    argv = [
        sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
        "--type", "process", "--name", f"det-tasks-{socket.gethostname()}"
        + ("" if pool == POOL else f"-{pool}"),
    ]  # fmt: skip
    return Service(
        name,
        argv,
        lambda: _worker_ready(config, name),
        config.root,
        env=env,
        start_timeout_s=60,
        stop_timeout_s=15,
        cwd=workdir,
    )


def flow_starter_service(config: StackConfig) -> Service:
    """The warm flow-run starter (``flows.flow_starter``) the stack's worker's flow runs are
    forked from, with the worker's environment: healthy once its socket answers."""
    path = socket_path(config.root)
    argv = [sys.executable, "-m", "flows.flow_starter", str(path)]
    return Service(
        "flow-starter",
        argv,
        lambda: _socket_answers(path),
        config.root,
        env=_worker_env(config),
        start_timeout_s=60,
        stop_timeout_s=10,
        cwd=config.project_dir,
    )


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


POOL = "local"


def _worker_ready(config: StackConfig, name: str = "prefect-worker") -> bool:
    log = config.root / "logs" / f"{name}.log"
    return log.exists() and "started!" in log.read_text(errors="replace")


def _run_module(
    config: StackConfig, module: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in this interpreter, against the stack (its Prefect and
    service settings in the environment), from the checkout; output captured."""
    env = {**os.environ, **_prefect_env(config), **env_for(config)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=config.project_dir,
        env=env,
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


def deploy(config: StackConfig | None = None) -> None:
    """Create the process work pool (once) and register prefect.yaml's deployments."""
    config = config or StackConfig.from_env()
    _ensure_work_pool(config)
    _register_deployments(config)


DEPLOYED_STAMP = "deployed"  # prefect.yaml's fingerprint when its deployments were registered


def _register_deployments(config: StackConfig) -> None:
    """``prefect deploy --all`` from the checkout; then the stamp that lets ``up`` skip it."""
    registering = deployments.fingerprint(config.project_dir)
    result = _run_module(config, "prefect", "--no-prompt", "deploy", "--all", check=False)
    if result.returncode != 0:
        raise ServiceError(
            f"prefect deploy failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    (config.root / DEPLOYED_STAMP).write_text(registering + "\n", encoding="utf-8")


def deployments_current(config: StackConfig) -> bool:
    """Whether the stack's Prefect server has prefect.yaml's deployments, registered from
    this checkout's prefect.yaml and flow sources as they are now."""
    auth = service_auth(config)["prefect_auth_string"] if config.auth else ""
    return deployments.is_current(
        config.root / DEPLOYED_STAMP, config.project_dir, config.prefect_api, auth
    )


def _ensure_work_pool(config: StackConfig) -> None:
    """The stack's process work pool, whose flow runs start Prefect's engine in one
    interpreter of this installation, in a session of its own (flows.work_pool,
    flows.engine_session): created, or its template brought to that, in one call whether
    or not it exists."""
    result = _run_module(config, "flows.work_pool", POOL, "--python", sys.executable, check=False)
    if result.returncode != 0:
        said = result.stdout + result.stderr
        raise ServiceError(f"could not create the work pool {POOL!r}:\n{said[-2000:]}")


def up(
    config: StackConfig | None = None, prefect: bool = True, register: bool = False
) -> dict[str, str]:
    """Start (or keep) SeaweedFS, MLflow, the Dask cluster and (unless ``prefect`` is
    False) a Prefect server and a process worker; returns the client environment. With
    ``register`` (``make up``) it also registers prefect.yaml's deployments, unless the
    server has them as they are now, so ``det experiment create`` works at once.

    Services that do not need each other start side by side: on a 2-core host a stack
    spends most of its start waiting on imports and health checks, not on one CPU."""
    config = config or StackConfig.from_env()
    check_mlflow_loop()
    seaweed = seaweed_service(config)
    ports = [config.s3_port, config.master_port, config.volume_port, config.filer_port]
    grpc = [p + config.seaweed_grpc_shift for p in ports]
    _check_ports_free(seaweed, ports + grpc, config.host)
    _check_ports_free(mlflow_service(config), [config.mlflow_port], config.host)
    if prefect:
        _check_ports_free(prefect_server_service(config), [config.prefect_port], config.host)
    if config.postgres_port:  # MLflow's and Prefect's databases: before either starts
        pg = postgres.postgres_service(config.root, config.postgres_port)
        _check_ports_free(pg, [config.postgres_port])
        postgres.prepare(config.root)
        start(pg)
        postgres.create_databases(config.root, config.postgres_port)
    independent = [seaweed, mlflow_service(config), *_dask_services(config)]
    if prefect:
        independent += [prefect_server_service(config), flow_starter_service(config)]
    start_all(independent)
    ensure_bucket(config)
    if prefect:
        _start_worker_and_register(config, register and not deployments_current(config))
    (config.root / "env").write_text(env_file_text(config))
    return env_for(config)


def _start_worker_and_register(config: StackConfig, register: bool) -> None:
    """The Prefect worker's start beside the work pool's creation and ``prefect deploy``
    (which needs the pool): each mostly waits on imports. The worker needs only the
    server: it creates the pool itself when it comes first, and either way round the
    other finds it there."""

    def pool_then_deployments() -> None:
        _ensure_work_pool(config)
        if register:
            _register_deployments(config)

    with ThreadPoolExecutor(max_workers=1) as background:
        preparing = background.submit(pool_then_deployments)
        start(prefect_worker_service(config))
        preparing.result()


def env_file_text(config: StackConfig) -> str:
    """``<root>/env``: the clients' settings, and PATH with this installation's scripts
    (``det``, ``det-tasks``, ``python``) first, so a shell that sources it needs no
    activated virtual environment."""
    scripts = sysconfig.get_path("scripts")
    lines = [f'export PATH="{scripts}:$PATH"']
    lines += [f"export {k}={v}" for k, v in env_for(config).items()]
    return "".join(f"{line}\n" for line in lines)


def _dask_services(config: StackConfig) -> list[Service]:
    address = dask_cluster.scheduler_address(config.dask_port, config.host)
    workers = dask_cluster.worker_services(
        config.root, address, env_for(config), config.dask_workers
    )
    scheduler = dask_cluster.scheduler_service(
        config.root, config.dask_port, config.host, *_slurm_workers(config)
    )
    return [scheduler, *workers]


def _slurm_workers(config: StackConfig) -> tuple[tuple[str, ...], dict[str, str]]:
    """The scheduler's preload and settings for Dask workers as Slurm jobs
    (cluster.slurm_workers), each job given this stack's client variables; none without
    ``slurm_workers``."""
    if not config.slurm_workers:
        return (), {}
    try:
        SlurmWorkerSettings.from_json(config.slurm_workers)
    except ValueError as err:
        raise ServiceError(str(err)) from None
    settings = json.loads(config.slurm_workers)
    settings["env"] = {**env_for(config), **settings.get("env", {})}
    env = {SLURM_WORKERS_ENV: json.dumps(settings)}  # the scheduler's, with the env added
    if settings.get("slurm_conf"):
        env["SLURM_CONF"] = settings["slurm_conf"]
    return ("cluster.slurm_workers",), env


def down(config: StackConfig | None = None) -> None:
    """Stop the stack, each service once those that write through it are gone: the Prefect
    worker, its flow starter and the Dask workers first, side by side (no flow run starts
    on a vanishing stack, and a worker's held trial ends, its last metrics and run state
    stored, while MLflow and S3 are still up: stopped beside them, a worker waited on them
    until it was KILLed); then the Prefect server, the Dask scheduler and MLflow side by
    side; then S3, after MLflow (it proxies artifact uploads to S3, so none is cut off
    midway); then PostgreSQL, after MLflow and Prefect have closed their connections."""
    config = config or StackConfig.from_env()
    scheduler, *workers = _dask_services(config)
    stop_all([prefect_worker_service(config), flow_starter_service(config), *workers])
    stop_all([prefect_server_service(config), scheduler, mlflow_service(config)])
    stop(seaweed_service(config))
    if config.postgres_port:
        stop(postgres.postgres_service(config.root, config.postgres_port))


def stack_services(config: StackConfig) -> list[Service]:
    """Every service of the stack, in the order ``status`` lists them."""
    services = [
        seaweed_service(config),
        mlflow_service(config),
        *_dask_services(config),
        prefect_server_service(config),
        flow_starter_service(config),
        prefect_worker_service(config),
    ]
    if config.postgres_port:
        services.insert(0, postgres.postgres_service(config.root, config.postgres_port))
    return services


def service_states(config: StackConfig) -> list[tuple[Service, str]]:
    """Each of the stack's services with "up" (its process runs and its health check
    passes) or "down": what ``status`` prints."""
    return up_or_down(stack_services(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "env", "deploy"])
    args = parser.parse_args(argv)
    config = StackConfig.from_env()
    try:
        if args.command == "up":
            env = up(config, register=True)
            print(
                # workflowType: MLflow 3.17 opens its GenAI pages without it.
                f"MLflow UI: {config.mlflow_uri}/#/experiments?workflowType=machine_learning   "
                f"Prefect UI: {config.prefect_api[:-4]}   "
                f"S3: {config.s3_endpoint} (bucket {BUCKET})"
            )
            print(
                "deployments (prefect.yaml): registered, experiment/submitted among them; "
                "`make deploy` registers them again"
            )
            print(f"environment for clients, and det on PATH: source {config.root / 'env'}")
            return 0 if env else 1
        if args.command == "deploy":
            deploy(config)
            print(
                "deployed: experiment/const, experiment/grid, experiment/adaptive, "
                "experiment/submitted, batch-inference/submitted, batch-inference/nightly "
                "(schedule inactive)"
            )
            return 0
        if args.command == "down":
            down(config)
            return 0
        if args.command == "env":
            print(env_file_text(config), end="")
            return 0
        print("\n".join(state_lines(service_states(config))))
        return 0
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
