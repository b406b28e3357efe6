"""Many hosts on one machine, for tests and for trying scale-out: ``python -m infra.hosts
up|down|status|heal`` (as root), or ``running(config)`` in a test fixture. ``heal`` brings
back what was lost (a host's worker, a cut link, a stopped service) and changes nothing
that runs.

Host 0 (this namespace, the bridge's address) runs the stack (infra/stack.py: SeaweedFS,
MLflow, Prefect server and worker, the Dask scheduler) bound to and advertising that address,
with no Dask worker of its own. Hosts 1..N (infra/netns.py: a network namespace each) run
one Dask worker each, started as docs/operations/scale-out.md tells an operator:
``dask worker tcp://SCHEDULER:PORT ... --preload cluster.held_trials`` with the stack's client
variables. Each host has its own address and hostname and writes only to a private tmpfs
(its /tmp, home, cache and Dask folder); the stack's folder and the checkout's tests (where
the example models live) are hidden from it, so model code reaches it only as S3 packages
and checkpoints only through S3.

Everything is removed on ``down``, when ``running`` ends, on an exception, on Ctrl-C and on
SIGTERM/SIGHUP: every process of every host, the namespaces, links and bridge, the stack.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from det_tasks.cpu_threads import threads_per_process
from infra import dask_cluster, netns, stack
from infra.netns import NetnsError, Network
from infra.services import (
    Service,
    ServiceError,
    is_running,
    start_all,
    state_lines,
    stop_all,
)
from infra.stack import StackConfig

__all__ = [
    "Hosts",
    "HostsConfig",
    "down",
    "heal",
    "heal_lines",
    "main",
    "running",
    "status_lines",
    "up",
    "worker_host_service",
]

REPO = Path(__file__).resolve().parents[1]
# Seconds a worker host may take to import torch and the harness and join the scheduler.
WORKER_START_TIMEOUT_S = 180


@dataclasses.dataclass(frozen=True)
class HostsConfig:
    """Where state lives (``root``: the stack's folder and the hosts' logs), the network,
    and the stack bound to its bridge address with no local Dask workers."""

    root: Path
    network: Network
    stack: StackConfig

    @classmethod
    def from_env(cls) -> HostsConfig:
        root = Path(os.environ.get("DET_TASKS_HOSTS_DIR", ".stack/hosts")).resolve()
        network = Network(
            hosts=int(os.environ.get("DET_TASKS_HOSTS", "2")),
            subnet=os.environ.get("DET_TASKS_HOSTS_SUBNET", "10.77.0"),
            prefix=os.environ.get("DET_TASKS_HOSTS_PREFIX", "dth"),
        )
        base = dataclasses.replace(stack.StackConfig.from_env(), root=root / "stack")
        return cls.on(root, network, base)

    @classmethod
    def on(cls, root: Path, network: Network, base: StackConfig) -> HostsConfig:
        """``base``'s ports and settings, its services on host 0's address."""
        services = dataclasses.replace(base, host=network.gateway, dask_workers=0)
        return cls(root=root, network=network, stack=services)

    def hostname(self, host: int) -> str:
        return f"{self.network.prefix}-host-{host}"

    @property
    def scheduler(self) -> str:
        return dask_cluster.scheduler_address(self.stack.dask_port, self.stack.host)


@dataclasses.dataclass(frozen=True)
class Hosts:
    """A running cluster: its config, the clients' environment (every address host 0's),
    and what acts on one host (lose it, cut its link)."""

    config: HostsConfig
    env: dict[str, str]

    @property
    def workers(self) -> list[int]:
        return list(range(1, self.config.network.hosts + 1))

    def hostname(self, host: int) -> str:
        return self.config.hostname(host)

    def address(self, host: int) -> str:
        return self.config.network.address(host)

    def host_of(self, worker_address: str) -> int:
        """The host whose address a Dask worker address (``tcp://IP:PORT``) names."""
        ip = worker_address.removeprefix("tcp://").rpartition(":")[0]
        for host in self.workers:
            if self.address(host) == ip:
                return host
        raise ValueError(f"{worker_address} is on none of the hosts {self.workers}")

    def lose(self, host: int) -> list[int]:
        """SIGKILL every process of ``host``; returns their pids."""
        return netns.kill_host(self.config.network, host)

    def cut(self, host: int, connected: bool = False) -> None:
        """Take ``host``'s link down (``connected`` True: bring it back up)."""
        netns.set_link(self.config.network, host, connected)

    def heal(self) -> list[int]:
        """Every link up and every host's worker running again (after ``lose`` or ``cut``);
        returns the hosts whose worker it started."""
        for host in self.workers:
            self.cut(host, connected=True)
        workers = _workers(self.config, threads_per_process(len(self.workers)))
        # A worker whose supervisor still runs rejoins by itself (after a cut link or a
        # scheduler restart): waited for, not restarted; a lost host's is started again.
        lost = [not is_running(worker) for worker in workers]
        started = start_all([w for w, gone in zip(workers, lost, strict=True) if gone])
        _await_rejoined([w for w, gone in zip(workers, lost, strict=True) if not gone])
        hosts = [host for host, gone in zip(self.workers, lost, strict=True) if gone]
        return [host for host, now in zip(hosts, started, strict=True) if now]


def _await_rejoined(workers: list[Service]) -> None:
    """Until each worker is registered with the scheduler again, up to its start timeout."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    waiting = list(workers)
    while waiting:
        waiting = [w for w in waiting if not w.healthy()]
        if waiting and time.monotonic() >= deadline:
            names = ", ".join(w.name for w in waiting)
            raise ServiceError(
                f"{names} did not rejoin the scheduler within {WORKER_START_TIMEOUT_S} s"
            )
        if waiting:
            time.sleep(0.3)


def worker_host_service(config: HostsConfig, host: int, threads: int = 1) -> Service:
    """Host ``host``'s Dask worker, as scale-out.md starts one, run inside the host: its
    folder, home and temp dir on the host's private tmpfs, the stack's folder and the
    checkout's tests out of its sight."""
    name = config.hostname(host)
    workdir = config.root / "hosts" / name  # hidden below: made afresh on a private mount
    env = {
        **stack.env_for(config.stack),
        "HOME": str(workdir / "home"),
        "DET_TASKS_HOME": str(workdir / "det"),
    }
    service = dask_cluster.worker_service(
        config.root, config.scheduler, name, workdir, env, threads=threads
    )
    hidden = [str(config.root), str(REPO / "tests")]
    argv = netns.host_argv(config.network, host, name, str(workdir), hidden, service.argv)
    timeout = WORKER_START_TIMEOUT_S
    return dataclasses.replace(service, argv=argv, cwd=None, start_timeout_s=timeout)


def _workers(config: HostsConfig, threads: int = 1) -> list[Service]:
    hosts = range(1, config.network.hosts + 1)
    return [worker_host_service(config, host, threads) for host in hosts]


def up(config: HostsConfig, register: bool = False) -> Hosts:
    """Build the network, start the stack on host 0 and a worker on each other host; on any
    failure, Ctrl-C included, remove everything it made and raise."""
    reason = netns.missing_requirements()
    if reason:
        raise NetnsError(reason)
    netns.remove_abandoned(config.network)  # a killed run's network: nothing runs in it
    taken = netns.leftovers(config.network)
    if taken:  # another cluster's: refused before the try, whose cleanup would remove it
        raise NetnsError(
            f"{', '.join(taken)} already exist: a cluster with prefix "
            f"{config.network.prefix!r} runs; stop it (python -m infra.hosts down) or set "
            "DET_TASKS_HOSTS_PREFIX and DET_TASKS_HOSTS_SUBNET to others"
        )
    threads = threads_per_process(config.network.hosts)
    try:
        netns.create(config.network)
        env = stack.up(config.stack, register=register)
        start_all(_workers(config, threads))
    except BaseException:
        down(config)
        raise
    return Hosts(config, env)


def down(config: HostsConfig) -> None:
    """Stop the worker hosts (their held trials end while MLflow and S3 are up), stop the
    stack, then kill whatever is left in the hosts' namespaces and remove them, their links
    and the bridge. Safe to call at any point, and again."""
    try:
        stop_all(_workers(config))
        stack.down(config.stack)
    finally:
        netns.destroy(config.network)  # first kills whatever still runs on a worker host


@contextlib.contextmanager
def running(config: HostsConfig) -> Iterator[Hosts]:
    """The cluster while the block runs; torn down after it, also when it raises or the
    process gets SIGTERM or SIGHUP (made SystemExit here, so the teardown runs)."""
    with _signals_as_exit():
        hosts = up(config)
        try:
            yield hosts
        finally:
            down(config)


@contextlib.contextmanager
def _signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread while the block
    runs (Ctrl-C already raises KeyboardInterrupt); the previous handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    saved = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def heal(config: HostsConfig) -> tuple[list[int], bool]:
    """Bring a running cluster back whole, idempotently: the stack's services that are down
    (the Dask scheduler among them) started again, every link up, every host's worker
    running. Returns the hosts whose worker it started, and whether the stack was whole."""
    whole = all(state == "up" for _, state in stack.service_states(config.stack))
    if not whole:
        stack.up(config.stack)
    return Hosts(config, stack.env_for(config.stack)).heal(), whole


def heal_lines(healed: tuple[list[int], bool]) -> str:
    hosts, whole = healed
    started = ", ".join(f"host {h}" for h in hosts)
    return "; ".join(
        [
            "services: all were up" if whole else "services: the ones that were down started",
            f"workers started on {started}" if hosts else "workers: all were up",
        ]
    )


def status_lines(config: HostsConfig) -> list[str]:
    """Each host with its address, hostname and whether its worker is up; the stack's
    services; what of the network exists."""
    exists = netns.leftovers(config.network)
    # Without the bridge, host 0's address would be sent out of this machine's own link.
    bridge_up = f"link {config.network.bridge}" in exists
    registered = dask_cluster.registered_workers(config.scheduler) if bridge_up else set()
    lines = [f"host 0  {config.network.gateway:15s} services (this namespace)"]
    for host in range(1, config.network.hosts + 1):
        name = config.hostname(host)
        state = "up" if name in registered else "down"
        lines.append(f"host {host}  {config.network.address(host):15s} {name} worker {state}")
    lines += state_lines(stack.service_states(config.stack))
    lines.append("network: " + (", ".join(exists) or "none"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.hosts", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "heal"])
    args = parser.parse_args(argv)
    try:
        config = HostsConfig.from_env()
        if args.command == "up":
            with _signals_as_exit():
                hosts = up(config, register=True)
            _print_up(hosts)
        elif args.command == "down":
            down(config)
        elif args.command == "heal":
            print(heal_lines(heal(config)))
        else:
            print("\n".join(status_lines(config)))
    except (NetnsError, ServiceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _print_up(hosts: Hosts) -> None:
    config = hosts.config
    print(
        f"host 0  {config.network.gateway}: MLflow {config.stack.mlflow_uri}, "
        f"S3 {config.stack.s3_endpoint}, Prefect {config.stack.prefect_api[:-4]}, "
        f"Dask {config.scheduler}"
    )
    for host in hosts.workers:
        print(
            f"host {host}  {hosts.address(host)}: worker {hosts.hostname(host)} "
            f"(ip netns exec {config.network.namespace(host)} ...)"
        )
    print(f"clients: source {config.stack.root / 'env'}; stop: python -m infra.hosts down")


if __name__ == "__main__":
    sys.exit(main())
