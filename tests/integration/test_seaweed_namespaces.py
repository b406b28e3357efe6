"""Two stacks' SeaweedFS on the same ports, each in its own network namespace, sharing the
machine's /tmp: each keeps its objects to itself (issue 50, item 9).

`weed server` listened on Unix sockets in /tmp named only by port, and its parts preferred
them to TCP: the second stack replaced the first's sockets, the first then listed the
second's objects and its own uploads failed. Each stack's sockets now live in its folder."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import netns
from infra.seaweed import ensure_bucket, s3_client, seaweed_service
from infra.services import stop
from infra.stack_config import BUCKET, StackConfig
from tests.integration.helpers import REPO, isolated_stack_config
from tests.integration.hosts_helpers import SPARE_SUBNET, needs_hosts, prefix

pytestmark = needs_hosts

# Started inside a namespace (`ip netns exec`, /tmp shared with the machine, as two
# containers or two users' namespaces share it); the service outlives this starter.
_START = """
import sys
from pathlib import Path
from infra.services import start
from infra.seaweed import seaweed_service
from tests.integration.helpers import isolated_stack_config
config = isolated_stack_config(Path(sys.argv[1]), 7, host=sys.argv[2])
start(seaweed_service(config))
"""


@contextlib.contextmanager
def _two_namespaces() -> Iterator[netns.Network]:
    net = netns.Network(hosts=2, subnet=SPARE_SUBNET, prefix=prefix("w"))
    netns.destroy(net)  # what a killed run of this test left
    netns.create(net)
    try:
        yield net
    finally:
        netns.destroy(net)


def _start_in(net: netns.Network, host: int, root: Path) -> StackConfig:
    config = isolated_stack_config(root, 7, host=net.address(host))
    subprocess.run(
        ["ip", "netns", "exec", net.namespace(host), sys.executable, "-c", _START, str(root),
         config.host],
        cwd=REPO,
        check=True,
        timeout=180,
    )  # fmt: skip
    return config


@pytest.mark.slow  # 23 s on an idle VM, 48 s at load
def test_two_stacks_on_the_same_ports_keep_their_objects_apart(tmp_path: Path) -> None:
    before = set(glob.glob("/tmp/seaweedfs-*.sock"))
    with _two_namespaces() as net, contextlib.ExitStack() as stops:
        stacks = {}
        for host, name in ((1, "a"), (2, "b")):
            stacks[name] = _start_in(net, host, tmp_path / name)
            stops.callback(stop, seaweed_service(stacks[name]))
        a, b = stacks["a"], stacks["b"]
        assert dataclasses.replace(a, root=b.root, host=b.host) == b  # the same ports
        for name, config in stacks.items():
            ensure_bucket(config)
            s3_client(config).put_object(Bucket=BUCKET, Key=f"only-{name}", Body=name * 1000)
        for name, config in stacks.items():
            client = s3_client(config)
            listed = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
            assert [o["Key"] for o in listed] == [f"only-{name}"]
            body = client.get_object(Bucket=BUCKET, Key=f"only-{name}")["Body"].read()
            assert body == name.encode() * 1000
        # Every socket SeaweedFS made is in its stack's folder, none in /tmp.
        assert set(glob.glob("/tmp/seaweedfs-*.sock")) == before
        for config in stacks.values():
            sockets = sorted(p.name for p in (config.root / "seaweed").glob("*.sock"))
            assert sockets == ["filer.sock", "s3.sock"]
