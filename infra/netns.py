"""Hosts of one machine as Linux network namespaces on a private bridge: each has its own
network stack and address, so a service bound to one host's address, or a hidden
``127.0.0.1``, behaves as it would across machines (infra/hosts.py builds a cluster on them).

Host 0 is this (root) namespace, through the bridge's own address ``<subnet>.1``; host ``i``
(1..N) is namespace ``<prefix><i>``, address ``<subnet>.<i+1>``, joined to the bridge by a
veth pair ``<prefix><i>-r`` (bridge side, where a link is cut) / ``<prefix><i>-n``.
Everything made is named by ``prefix``, so ``destroy`` finds it all, even what a killed
process left behind. Needs root and iproute2's ``ip`` (``missing_requirements`` says which).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "Network",
    "NetnsError",
    "abandoned",
    "create",
    "destroy",
    "host_argv",
    "kill_host",
    "leftovers",
    "missing_requirements",
    "namespace_pids",
    "remove_abandoned",
    "set_link",
]

_logger = logging.getLogger(__name__)

_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,5}$")  # leaves room for "<prefix>199-r" in 15 chars
_SUBNET = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")
MAX_HOSTS = 200


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made or removed; says which and why."""


@dataclasses.dataclass(frozen=True)
class Network:
    """``hosts`` worker hosts on the /24 ``subnet`` (its first three octets)."""

    hosts: int = 2
    subnet: str = "10.77.0"
    prefix: str = "dth"

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ValueError(
                f"network prefix {self.prefix!r} is not 1-6 lowercase letters or digits "
                "starting with a letter (interface names are at most 15 characters)"
            )
        octets = _SUBNET.match(self.subnet)
        if not octets or any(int(o) > 255 for o in octets.groups()):
            raise ValueError(
                f"subnet {self.subnet!r} is not the first three octets of a /24, "
                "e.g. DET_TASKS_HOSTS_SUBNET=10.77.0"
            )
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1 to {MAX_HOSTS}, got {self.hosts}")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def gateway(self) -> str:
        """Host 0's address: the bridge's, in this namespace."""
        return f"{self.subnet}.1"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}{host}"

    def address(self, host: int) -> str:
        return self.gateway if host == 0 else f"{self.subnet}.{host + 1}"

    def veth(self, host: int) -> str:
        """The bridge side of host ``host``'s link: down, the host is cut off."""
        return f"{self.prefix}{host}-r"

    def peer(self, host: int) -> str:
        return f"{self.prefix}{host}-n"


def missing_requirements() -> str | None:
    """Why namespaces cannot be built here (not root, no ``ip`` or ``unshare``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, mount): run as root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install {package}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def create(net: Network) -> None:
    """The bridge with host 0's address, and each worker host's namespace, link and
    address. Whatever was made is removed again if any step fails."""
    if leftovers(net):
        raise NetnsError(
            f"{', '.join(leftovers(net))} already exist: another cluster uses prefix "
            f"{net.prefix!r}; stop it (python -m infra.hosts down) or choose another prefix"
        )
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for host in range(1, net.hosts + 1):
            _add_host(net, host)
    except BaseException:
        destroy(net)
        raise


def _add_host(net: Network, host: int) -> None:
    ns = net.namespace(host)
    _ip("netns", "add", ns)
    _ip("link", "add", net.veth(host), "type", "veth", "peer", "name", net.peer(host), "netns", ns)
    _ip("link", "set", net.veth(host), "master", net.bridge, "up")
    _ip("-n", ns, "addr", "add", f"{net.address(host)}/24", "dev", net.peer(host))
    _ip("-n", ns, "link", "set", net.peer(host), "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def _namespaces(net: Network) -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    return [n for n in names if re.fullmatch(rf"{net.prefix}\d+", n)]


def _links(net: Network) -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    mine = re.compile(rf"^{net.prefix}(\d+-r|-br)$")
    return [n for n in names if mine.match(n)]


def leftovers(net: Network) -> list[str]:
    """Namespaces and links of ``net``'s prefix that exist now (empty after ``destroy``)."""
    return [f"namespace {n}" for n in _namespaces(net)] + [f"link {n}" for n in _links(net)]


def abandoned(net: Network) -> bool:
    """Whether ``net``'s prefix has host namespaces and not one process in any of them: a
    cluster whose owner was killed before it could remove them (a SIGKILLed or timed-out
    run), which nothing can be using. A bridge alone is not (a cluster being made)."""
    namespaces = _namespaces(net)
    return bool(namespaces) and not any(namespace_pids(ns) for ns in namespaces)


def remove_abandoned(net: Network) -> None:
    """Remove what a killed cluster of ``net``'s prefix left (``abandoned``), saying so;
    leave a live one alone, for the caller to refuse."""
    if abandoned(net):
        _logger.warning(
            "removing %s, left by a cluster that is no longer running", ", ".join(leftovers(net))
        )
        destroy(net)


def namespace_pids(namespace: str) -> list[int]:
    """Every process in ``namespace`` (its network namespace), whoever started it."""
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def kill_host(net: Network, host: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of host ``host`` (a machine losing power); returns their pids
    once none is left."""
    ns = net.namespace(host)
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := namespace_pids(ns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed += [p for p in pids if p not in killed]
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} of {ns} outlived SIGKILL for {timeout_s:.0f} s")
        time.sleep(0.1)
    return killed


def set_link(net: Network, host: int, up: bool) -> None:
    """Cut host ``host`` off the bridge (``up`` False) or connect it again."""
    _ip("link", "set", net.veth(host), "up" if up else "down")


def destroy(net: Network) -> None:
    """Kill every process left in ``net``'s namespaces, then remove the namespaces, links
    and bridge: everything ``create`` made under this prefix, whether or not it all exists.
    Raises NetnsError naming what could not be removed."""
    for ns in _namespaces(net):
        host = int(ns[len(net.prefix) :])
        kill_host(net, host)
        _ip("netns", "del", ns, check=False)
    for link in _links(net):  # a veth goes with its namespace; the bridge does not
        _ip("link", "del", link, check=False)
    left = leftovers(net)
    if left:
        raise NetnsError(f"could not remove {', '.join(left)}")


# Runs as the host's first process: its own hostname and mount namespace, a private /tmp
# (what must stay visible under /tmp, the installation a worker runs from, is bound back
# into it from the old /tmp, kept reachable for a moment under /run), the folders other
# hosts write hidden under empty tmpfs mounts, then the command.
_HOST_SCRIPT = """set -e
hostname "$0"
old=/run/det-tasks-host-$$
mkdir -p "$old"
mount --bind /tmp "$old"
mount -t tmpfs -o mode=1777 tmpfs /tmp
for keep in $2; do
  case "$keep" in /tmp/*) mkdir -p "$keep"; mount --bind "$old/${keep#/tmp/}" "$keep";; esac
done
umount -l "$old"
rmdir "$old"
for hidden in $1; do
  if [ -d "$hidden" ]; then mount -t tmpfs -o mode=0755 tmpfs "$hidden"; fi
done
mkdir -p "$3"
cd "$3"
shift 3
exec "$@"
"""


def host_argv(
    net: Network,
    host: int,
    hostname: str,
    workdir: str,
    hidden: Sequence[str],
    argv: list[str],
    shared: Sequence[str] = (),
) -> list[str]:
    """``argv`` run on host ``host``: in its network namespace, with its own ``hostname``,
    a private ``/tmp``, the folders ``hidden`` (other hosts' files) out of sight, and
    ``workdir`` (created on a private mount, e.g. under /tmp or a hidden folder) as its
    current directory. ``shared`` folders stay in sight even under /tmp: what a site
    shares with every host (a Slurm site's configuration and scratch)."""
    keep = sorted({*_installation(), *shared})
    if any(" " in path for path in [*hidden, *keep]):
        raise ValueError(f"hidden or kept folders may not contain spaces: {[*hidden, *keep]}")
    return [
        "ip", "netns", "exec", net.namespace(host),
        "unshare", "--mount", "--uts", "--propagation", "private",
        "sh", "-c", _HOST_SCRIPT, hostname, " ".join(hidden), " ".join(keep), workdir,
        *argv,
    ]  # fmt: skip


def _installation() -> list[str]:
    """What a host runs from and must still see under its private /tmp: the checkout and
    the Python environment (a CI clone or a virtualenv may live under /tmp)."""
    checkout = Path(__file__).resolve().parents[1]
    return sorted({str(checkout), sys.prefix, sys.base_prefix})
