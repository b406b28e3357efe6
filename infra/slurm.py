"""A real Slurm site on this machine's namespaced hosts, for tests and for the docs:
``python -m infra.slurm up|down|status`` (as root), or ``running(site)`` in a fixture.

Host 0 (this namespace, the bridge's address) is the site's controller and login node:
``slurmctld`` and MUNGE's ``munged`` run there, and ``sbatch``/``sinfo`` are called there.
Hosts 1..N (infra/netns.py) are compute nodes: each runs ``slurmd`` in its own network
namespace, with its own address, hostname and private ``/tmp`` (its spool and pid files).
They share what a site shares: ``slurm.conf`` and MUNGE (here one ``munged`` whose socket
every host reaches in the site's folder, standing in for a daemon per node with one key),
and a scratch folder for job output. The site's folder, not the stack's, is visible to
them: the stack's stays hidden, as on :mod:`infra.hosts`.

Debian's ``slurm-wlm`` (22.05) provides the daemons: ``apt-get install -y slurm-wlm``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.slurm_settings import SlurmWorkerSettings
from infra import netns
from infra.netns import NetnsError, Network
from infra.services import Service, ServiceError, start_all, state_lines, stop_all, up_or_down

if TYPE_CHECKING:
    from infra.stack import StackConfig

__all__ = [
    "SlurmSite",
    "client_env",
    "down",
    "main",
    "missing_requirements",
    "node_states",
    "running",
    "site_services",
    "slurm_conf_text",
    "up",
]

REPO = Path(__file__).resolve().parents[1]
# Seconds a daemon may take to come up and, for a node, to register with the controller.
START_TIMEOUT_S = 60
_NODE_UP_STATES = ("idle", "mix", "alloc", "comp")  # sinfo's short states of a usable node


@dataclasses.dataclass(frozen=True)
class SlurmSite:
    """A Slurm site: its folder, the hosts (host 0 the controller, 1..N compute nodes),
    the controller's port, its partitions (the default one, and an urgent one whose jobs
    preempt it) and what each node offers."""

    root: Path
    network: Network
    ctld_port: int = 26817
    slurmd_port: int = 26818
    partition: str = "batch"
    urgent_partition: str = "urgent"  # its jobs preempt the default partition's
    grace_time_s: int = 120  # a preempted job's time between its signal and SIGKILL
    cpus_per_node: int = 2
    memory_mb_per_node: int = 4000
    cluster_name: str = "dettasks"
    # Folders no compute node may see (a stack's on host 0), beyond the controller's state.
    hidden: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> SlurmSite:
        offset = int(os.environ.get("DET_TASKS_SLURM_PORT_OFFSET", "0"))
        return cls(
            root=Path(os.environ.get("DET_TASKS_SLURM_DIR", ".stack/slurm")).resolve(),
            network=Network(
                hosts=int(os.environ.get("DET_TASKS_SLURM_NODES", "2")),
                subnet=os.environ.get("DET_TASKS_SLURM_SUBNET", "10.78.0"),
                prefix=os.environ.get("DET_TASKS_SLURM_PREFIX", "dts"),
            ),
            ctld_port=26817 + offset,
            slurmd_port=26818 + offset,
        )

    @property
    def controller_host(self) -> str:
        return self.network.gateway

    def node_name(self, host: int) -> str:
        return f"{self.network.prefix}-node-{host}"

    @property
    def nodes(self) -> list[str]:
        return [self.node_name(h) for h in range(1, self.network.hosts + 1)]

    @property
    def conf(self) -> Path:
        return self.root / "site" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "site" / "munge" / "munge.sock"

    @property
    def scratch(self) -> Path:
        """The folder every node shares with the login node: job output, as a site's
        shared scratch or home."""
        return self.root / "site" / "scratch"


def missing_requirements() -> str | None:
    """Why a site cannot be built here (no root, no namespaces, no Slurm), or None."""
    reason = netns.missing_requirements()
    if reason:
        return reason
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install -y slurm-wlm"
    return None


def slurm_conf_text(site: SlurmSite) -> str:
    """The site's ``slurm.conf``: root daemons, MUNGE through the site's socket, two
    partitions of every node (the urgent one preempts the other, with requeue). Node state
    and spool files stay on each node (``%n``, its own ``/tmp``); the controller's state in
    the site's folder."""
    state = site.root / "ctld"
    nodes = [
        f"NodeName={site.node_name(h)} NodeAddr={site.network.address(h)} "
        f"CPUs={site.cpus_per_node} RealMemory={site.memory_mb_per_node} State=UNKNOWN"
        for h in range(1, site.network.hosts + 1)
    ]
    lines = [
        f"ClusterName={site.cluster_name}",
        # The controller's name must be this host's: slurmctld refuses to run elsewhere.
        f"SlurmctldHost={socket.gethostname()}({site.controller_host})",
        f"SlurmctldPort={site.ctld_port}",
        f"SlurmdPort={site.slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={site.munge_socket}",
        # No cgroups in a namespaced host: processes are tracked through /proc.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        # A node that comes back (its host healed) serves again by itself.
        "ReturnToService=2",
        # A job past its time limit gets KillWait seconds between SIGTERM and SIGKILL.
        "KillWait=30",
        f"StateSaveLocation={state}",
        f"SlurmctldPidFile={state}/slurmctld.pid",
        "SlurmdSpoolDir=/tmp/%n",  # each node's working folder on its private /tmp
        "SlurmdPidFile=/tmp/%n/slurmd.pid",
        *nodes,
        # A site's high-priority queue: a job of the urgent partition preempts one of the
        # default partition where it needs its node. The preempted job gets its own
        # --signal at once (preempt_send_user_signal: a worker job's warning, so its
        # trial checkpoints where it stands), GraceTime seconds before SIGKILL, and is
        # requeued.
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "SlurmctldParameters=preempt_send_user_signal",
        f"PartitionName={site.partition} Nodes={','.join(site.nodes)} Default=YES "
        f"MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={site.grace_time_s}",
        f"PartitionName={site.urgent_partition} Nodes={','.join(site.nodes)} "
        "MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
    ]
    return "".join(f"{line}\n" for line in lines)


def stack_on_site(config: StackConfig, site: SlurmSite, memory: str = "3GB") -> StackConfig:
    """``config`` as a stack on the site's login host (host 0) with no worker of its own:
    its Dask workers are the site's Slurm jobs (cluster.slurm_workers) of ``memory`` each,
    in the default partition, their output in the site's shared scratch."""
    settings = SlurmWorkerSettings(
        partition=site.partition, memory=memory, slurm_conf=str(site.conf),
        output_dir=str(site.scratch),
    )  # fmt: skip
    return dataclasses.replace(
        config, host=site.network.gateway, dask_workers=0, slurm_workers=settings.to_json()
    )


def client_env(site: SlurmSite) -> dict[str, str]:
    """What ``sbatch``, ``squeue``, ``scancel`` and ``sinfo`` on the login node need."""
    return {"SLURM_CONF": str(site.conf)}


def _prepare(site: SlurmSite) -> None:
    """The site's shared files: ``slurm.conf``, the MUNGE key (kept across restarts), the
    controller's state folder, the shared scratch."""
    (site.root / "ctld").mkdir(parents=True, exist_ok=True)
    site.munge_socket.parent.mkdir(parents=True, exist_ok=True)
    site.scratch.mkdir(parents=True, exist_ok=True)
    key = site.root / "site" / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    site.conf.write_text(slurm_conf_text(site))


def _munged(site: SlurmSite) -> Service:
    folder = site.munge_socket.parent
    argv = [
        "munged", "--foreground", "--force", f"--socket={site.munge_socket}",
        f"--key-file={site.root / 'site' / 'munge.key'}", f"--log-file={folder / 'munged.log'}",
        f"--pid-file={folder / 'munged.pid'}", f"--seed-file={folder / 'munged.seed'}",
    ]  # fmt: skip
    return Service(
        "munged", argv, lambda: site.munge_socket.exists(), site.root,
        start_timeout_s=START_TIMEOUT_S, stop_timeout_s=10,
    )  # fmt: skip


def _slurmctld(site: SlurmSite) -> Service:
    argv = ["slurmctld", "-D", "-f", str(site.conf)]
    return Service(
        "slurmctld", argv, lambda: _controller_answers(site), site.root,
        env=client_env(site), start_timeout_s=START_TIMEOUT_S, stop_timeout_s=15,
    )  # fmt: skip


def _slurmd(site: SlurmSite, host: int) -> Service:
    """Host ``host``'s ``slurmd``, run inside the host: its own address and hostname, its
    spool on its private ``/tmp``, the site's controller state out of its sight."""
    name = site.node_name(host)
    # `ip netns exec` mounts a fresh /sys, without the cgroup hierarchies slurmd's cgroup
    # plugin looks for: the machine's (as PID 1 sees them) are mounted again, in the
    # host's own mount namespace.
    argv = [
        "sh",
        "-c",
        _CGROUPS_THEN_EXEC,
        "slurmd",
        "slurmd",
        "-D",
        "-f",
        str(site.conf),
        "-N",
        name,
    ]
    hidden = [str(site.root / "ctld"), str(REPO / "tests"), *site.hidden]
    workdir = f"/tmp/{name}"
    shared = [str(site.root / "site")]
    wrapped = netns.host_argv(site.network, host, name, workdir, hidden, argv, shared)
    return Service(
        f"slurmd-{name}", wrapped, lambda: node_states(site).get(name) in _NODE_UP_STATES,
        site.root, env=client_env(site), start_timeout_s=START_TIMEOUT_S, stop_timeout_s=15,
    )  # fmt: skip


_CGROUPS_THEN_EXEC = """set -e
if ! grep -q ' /sys/fs/cgroup ' /proc/self/mounts; then
  grep ' /sys/fs/cgroup' /proc/1/mounts | while read -r _ path kind options _; do
    case "$kind" in
      tmpfs) mount -t tmpfs -o mode=0755 cgroup "$path";;
      cgroup|cgroup2) mkdir -p "$path"; mount -t "$kind" -o "$options" cgroup "$path";;
    esac
  done
fi
exec "$@"
"""


def site_services(site: SlurmSite) -> list[Service]:
    """MUNGE, the controller, then a ``slurmd`` per compute node: the order they start in."""
    return [_munged(site), _slurmctld(site), *(_slurmd(site, h) for h in _hosts(site))]


def _hosts(site: SlurmSite) -> range:
    return range(1, site.network.hosts + 1)


def _controller_answers(site: SlurmSite) -> bool:
    done = _slurm_command(site, ["scontrol", "ping"])
    return done is not None and done.returncode == 0 and "is UP" in done.stdout


def node_states(site: SlurmSite) -> dict[str, str]:
    """Each node's short state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*`` ...)."""
    done = _slurm_command(site, ["sinfo", "--noheader", "--Node", "--format=%N %t"])
    if done is None or done.returncode != 0:
        return {}
    pairs = (line.split() for line in done.stdout.splitlines() if line.strip())
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def _slurm_command(site: SlurmSite, argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=20,
            env={**os.environ, **client_env(site)},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None


def up(site: SlurmSite) -> dict[str, str]:
    """Build the hosts' network, then start MUNGE, the controller and every node's
    ``slurmd``; returns the login node's client environment. On any failure, Ctrl-C
    included, everything it made is removed again."""
    reason = missing_requirements()
    if reason:
        raise NetnsError(reason)
    netns.remove_abandoned(site.network)  # a killed run's network: nothing runs in it
    taken = netns.leftovers(site.network)
    if taken:
        raise NetnsError(
            f"{', '.join(taken)} already exist: a site with prefix {site.network.prefix!r} "
            "runs; stop it (python -m infra.slurm down) or set DET_TASKS_SLURM_PREFIX and "
            "DET_TASKS_SLURM_SUBNET to others"
        )
    try:
        netns.create(site.network)
        _prepare(site)
        munged, ctld, *nodes = site_services(site)
        start_all([munged])
        start_all([ctld])
        start_all(nodes)
    except BaseException:
        down(site)
        raise
    return client_env(site)


def down(site: SlurmSite) -> None:
    """Cancel every job, stop the nodes, the controller and MUNGE, then remove the hosts.
    Safe to call at any point, and again."""
    try:
        if _controller_answers(site):
            _slurm_command(site, ["scancel", "--full", f"--partition={site.partition}"])
        munged, ctld, *nodes = site_services(site)
        stop_all(nodes)
        stop_all([ctld])
        stop_all([munged])
    finally:
        netns.destroy(site.network)  # first kills whatever still runs on a node's host


@contextlib.contextmanager
def running(site: SlurmSite) -> Iterator[dict[str, str]]:
    """The site while the block runs, torn down after it, also when it raises."""
    env = up(site)
    try:
        yield env
    finally:
        down(site)


def status_lines(site: SlurmSite) -> list[str]:
    states = node_states(site)
    lines = [f"controller {site.controller_host}:{site.ctld_port} (host 0)"]
    for host in _hosts(site):
        name = site.node_name(host)
        lines.append(
            f"host {host}  {site.network.address(host):15s} {name} {states.get(name, '?')}"
        )
    return lines + state_lines(up_or_down(site_services(site)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.slurm", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    site = SlurmSite.from_env()
    try:
        if args.command == "up":
            up(site)
            print(f"Slurm site up: nodes {', '.join(site.nodes)} in partition {site.partition}")
            print(f"clients: export SLURM_CONF={site.conf}; stop: python -m infra.slurm down")
        elif args.command == "down":
            down(site)
        else:
            print("\n".join(status_lines(site)))
    except (NetnsError, ServiceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
