"""Warm services for the no-server mode, kept running between experiments as ``ray start``
keeps a Ray cluster: a Prefect server (with its UI) and a Dask scheduler with warm workers,
for this installation's home (``det_tasks.home``).

Why: an embedded ``python -m flows.experiment`` starts Prefect's server and a Dask cluster
and imports torch, Prefect and MLflow in each of them, every run: about two thirds of a small
experiment's wall time on a 2-core machine. Started once here, later runs find them through
the home's ``warm/services.json`` (``flows.embedded.attach_warm_services``) and pay only
their own process's start. Runs still record to the home's MLflow store and artifacts, as
without warm services; the workers are given the same settings, and a run whose recording
settings differ from theirs (``det_tasks.home.RECORDING_SETTINGS``) starts its own.

``python -m infra.warm_home start|stop|status``; ``DET_TASKS_DASK_WORKERS`` (default 2)
workers, or on a host with GPUs one worker per GPU that owns it (Dask resource ``GPU=1``,
as the embedded cluster gives 1-slot trials); a run whose trials need more GPUs than one
warm worker owns starts its own cluster instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from contextlib import ExitStack
from pathlib import Path

from det_tasks.cpu_threads import worker_share
from det_tasks.home import (
    RECORDING_SETTINGS,
    det_tasks_home,
    no_server_recording,
    warm_record,
    warm_services_file,
)
from infra import dask_cluster
from infra.services import (
    Service,
    ServiceError,
    is_running,
    start_all,
    state_lines,
    stop_all,
    up_or_down,
)
from infra.stack import StackConfig, prefect_server_service

__all__ = ["services", "start", "status", "stop"]

# Set in a shell that points at servers (``source .stack/env``): the warm services would
# serve runs that record elsewhere, or Prefect's server would think it is its own client.
_SERVER_SETTINGS = ("PREFECT_API_URL", "DET_TASKS_DASK_SCHEDULER")
_PORTS = ("prefect_port", "dask_port")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open while chosen)."""
    with ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def _root() -> Path:
    return warm_services_file().parent


def _recorded() -> dict[str, str]:
    """What ``start`` recorded, or {} when there is no usable record."""
    recorded = warm_record()
    if not all(recorded.get(key, "").isdigit() for key in (*_PORTS, "workers", "gpus_per_worker")):
        return {}
    return recorded


def _worker_settings(home: Path) -> dict[str, str]:
    """The workers record where a run without servers does, in the same home."""
    return {"DET_TASKS_HOME": str(home.resolve()), **no_server_recording(home)}


def _gpu_count() -> int:
    from cluster.devices import gpu_count

    return gpu_count()


def services(
    prefect_port: int, dask_port: int, workers: int, gpus_per_worker: int = 0
) -> list[Service]:
    """The Prefect server, the Dask scheduler and ``workers`` workers (worker i owning GPU
    i where ``gpus_per_worker``), rooted in the home's ``warm`` folder (logs, pid files,
    Prefect's database)."""
    root = _root()
    config = StackConfig(root=root, prefect_port=prefect_port, dask_port=dask_port)
    address = dask_cluster.scheduler_address(dask_port)
    env = _worker_settings(det_tasks_home())
    prefix = "dask-worker-gpu" if gpus_per_worker else "dask-worker-"
    threads = worker_share(workers)
    pool = [
        dask_cluster.worker_service(
            root,
            address,
            f"{prefix}{i}",
            env=env,
            gpus=[i] if gpus_per_worker else None,
            threads=threads,
        )
        for i in range(workers)
    ]
    return [prefect_server_service(config), dask_cluster.scheduler_service(root, dask_port), *pool]


def _current() -> list[Service]:
    """The recorded services, plus any whose pid file is left in the home's ``warm``
    folder (a start that failed, a record lost): stop must find every one."""
    recorded = _recorded()
    known = (
        services(
            int(recorded["prefect_port"]),
            int(recorded["dask_port"]),
            int(recorded["workers"]),
            int(recorded["gpus_per_worker"]),
        )
        if recorded
        else []
    )
    names = {service.name for service in known}
    leftovers = [
        Service(pidfile.stem, [], lambda: False, _root())
        for pidfile in sorted((_root() / "pids").glob("*.pid"))
        if pidfile.stem not in names
    ]
    return known + leftovers


def _refuse_server_settings() -> None:
    chosen = [name for name in _SERVER_SETTINGS if os.environ.get(name)]
    chosen += [
        name
        for name, default in no_server_recording(det_tasks_home()).items()
        if os.environ.get(name, default) != default
    ]
    if chosen:
        raise ServiceError(
            f"{', '.join(chosen)} set in this shell (a `source .stack/env`?): warm services "
            "serve runs without servers, which record to the home's MLflow store; "
            "unset them first, or run on that stack instead"
        )


def start() -> dict[str, str]:
    """Start the warm services (or keep those running) and record where they answer and
    what their workers record to; returns what ``services.json`` holds."""
    _refuse_server_settings()
    recorded = _recorded()
    running = [s for s in _current() if is_running(s)]
    if recorded and running:
        prefect_port, dask_port = (int(recorded[key]) for key in _PORTS)
    else:
        prefect_port, dask_port = _free_ports(2)
    gpus = _gpu_count()
    workers = gpus or int(os.environ.get("DET_TASKS_DASK_WORKERS", "2"))
    gpus_per_worker = 1 if gpus else 0  # what one worker owns; a run needing more starts its own
    wanted = services(prefect_port, dask_port, workers, gpus_per_worker)
    stop_all([s for s in running if s.name not in {w.name for w in wanted}])
    try:
        start_all(wanted)
    except BaseException:
        stop_all(wanted)  # none of a failed start outlives it
        raise
    seen_by_workers = {**os.environ, **_worker_settings(det_tasks_home())}
    description = {
        "prefect_port": str(prefect_port),
        "dask_port": str(dask_port),
        "workers": str(workers),
        "gpus_per_worker": str(gpus_per_worker),
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "DET_TASKS_DASK_SCHEDULER": dask_cluster.scheduler_address(dask_port),
        **{name: seen_by_workers.get(name, "") for name in RECORDING_SETTINGS},
    }
    path = warm_services_file()
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(description, indent=2))
    partial.replace(path)  # a run never reads half a file
    return description


def stop() -> None:
    """Stop the warm services; later runs start their own again."""
    current = _current()
    warm_services_file().unlink(missing_ok=True)  # first: no new run attaches meanwhile
    stop_all(current)


def status() -> list[tuple[Service, str]]:
    """Each warm service with "up" (its process runs and answers) or "down"."""
    return up_or_down(_current())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.warm_home", description=__doc__)
    parser.add_argument("command", choices=["start", "stop", "status"])
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            described = start()
            print(
                f"warm services for {det_tasks_home()}: "
                f"Prefect UI {described['PREFECT_API_URL'][:-4]}, "
                f"Dask {described['DET_TASKS_DASK_SCHEDULER']} "
                f"({described['workers']} workers"
                f"{', one per GPU' if described['gpus_per_worker'] != '0' else ''}); "
                "`python -m flows.experiment` now runs on them; "
                "stop: python -m infra.warm_home stop"
            )
            return 0
        if args.command == "stop":
            stop()
            return 0
        states = status()
        if not states:
            print(f"no warm services for {det_tasks_home()}")
        for line in state_lines(states):
            print(line)
        return 0
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
