"""infra/netns.py and infra/hosts.py without namespaces: names and addresses, refused
settings, the command a host runs, signals made exits, and that a failed `up` removes what
it made (the real teardown runs in tests/integration/test_hosts.py, as root)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from infra import hosts, netns
from infra.netns import Network
from infra.stack import StackConfig


def test_names_and_addresses_follow_the_prefix_and_subnet() -> None:
    net = Network(hosts=3, subnet="10.77.0", prefix="dth")
    assert (net.bridge, net.gateway) == ("dth-br", "10.77.0.1")
    assert [net.address(h) for h in range(4)] == [
        "10.77.0.1",
        "10.77.0.2",
        "10.77.0.3",
        "10.77.0.4",
    ]
    assert (net.namespace(2), net.veth(2), net.peer(2)) == ("dth2", "dth2-r", "dth2-n")
    longest = Network(hosts=netns.MAX_HOSTS, prefix="abcdef")
    assert len(longest.veth(netns.MAX_HOSTS)) <= 15  # Linux's limit on interface names


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"prefix": "Dth"}, "network prefix 'Dth'"),
        ({"prefix": "toolong1"}, "network prefix 'toolong1'"),
        ({"subnet": "10.77.0.0/24"}, "subnet '10.77.0.0/24'"),
        ({"subnet": "10.300.0"}, "subnet '10.300.0'"),
        ({"hosts": 0}, "hosts must be 1 to 200, got 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        Network(**settings)


def test_the_stack_moves_to_host_0s_address_with_no_local_workers(tmp_path: Path) -> None:
    base = StackConfig(root=tmp_path / "stack", mlflow_port=5101)
    config = hosts.HostsConfig.on(tmp_path, Network(subnet="10.79.3"), base)
    assert config.stack.host == "10.79.3.1" and config.stack.dask_workers == 0
    assert config.stack.mlflow_uri == "http://10.79.3.1:5101"
    assert config.scheduler == "tcp://10.79.3.1:8786"
    assert StackConfig(root=tmp_path).mlflow_uri == "http://127.0.0.1:5001"  # the default


def test_a_worker_host_runs_scale_outs_command_inside_its_namespace(tmp_path: Path) -> None:
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path / "stack"))
    service = hosts.worker_host_service(config, 2)
    argv = service.argv
    assert argv[:4] == ["ip", "netns", "exec", "dth2"]
    assert argv[argv.index("-c") + 2] == "dth-host-2"  # its hostname
    hidden = argv[argv.index("-c") + 3].split()
    assert hidden == [str(tmp_path), str(hosts.REPO / "tests")]
    command = argv[argv.index("distributed.cli.dask_worker") + 1 :]
    assert command[:3] == ["tcp://10.77.0.1:8786", "--name", "dth-host-2"]
    assert "--preload" in command and "cluster.held_trials" in command
    assert service.env["MLFLOW_TRACKING_URI"] == "http://10.77.0.1:5001"
    assert service.env["MLFLOW_S3_ENDPOINT_URL"] == "http://10.77.0.1:8333"
    assert service.env["HOME"].startswith(str(tmp_path))  # under a hidden folder: private
    assert service.env["DASK_DISTRIBUTED__WORKER__DAEMON"] == "False"


def test_host_of_maps_a_worker_address_to_its_host(tmp_path: Path) -> None:
    config = hosts.HostsConfig.on(tmp_path, Network(hosts=2), StackConfig(root=tmp_path))
    cluster = hosts.Hosts(config, {})
    assert cluster.host_of("tcp://10.77.0.3:40111") == 2
    with pytest.raises(ValueError, match=re.escape("tcp://127.0.0.1:1 is on none of the hosts")):
        cluster.host_of("tcp://127.0.0.1:1")


def test_sigterm_becomes_an_exit_that_runs_the_teardown() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited, hosts._signals_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # the handler raises before this waits
    assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("failure", [RuntimeError("mlflow did not start"), KeyboardInterrupt()])
def test_a_failed_up_removes_what_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(netns, "missing_requirements", lambda: None)
    monkeypatch.setattr(netns, "leftovers", lambda net: [])
    monkeypatch.setattr(netns, "create", lambda net: calls.append("create"))

    def stack_up(config: StackConfig, register: bool) -> dict[str, str]:
        raise failure

    monkeypatch.setattr(hosts.stack, "up", stack_up)
    monkeypatch.setattr(hosts, "down", lambda config: calls.append("down"))
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path))
    with pytest.raises(type(failure)):
        hosts.up(config)
    assert calls == ["create", "down"]


def test_up_says_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path))
    with pytest.raises(netns.NetnsError, match="network namespaces need root"):
        hosts.up(config)


def test_up_refuses_a_prefix_in_use_and_leaves_that_cluster_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[str] = []
    monkeypatch.setattr(netns, "missing_requirements", lambda: None)
    monkeypatch.setattr(netns, "leftovers", lambda net: ["link dth-br"])
    monkeypatch.setattr(hosts, "down", lambda config: removed.append("down"))
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path))
    with pytest.raises(netns.NetnsError, match="link dth-br already exist: a cluster with prefix"):
        hosts.up(config)
    assert removed == []


def test_up_removes_a_killed_clusters_empty_namespaces_and_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed before its teardown (CI's time limit) left the prefix's namespaces with
    no process in them: the next `up` removes them, says so, and builds its own."""
    calls: list[str] = []
    left = ["namespace dth1", "namespace dth2", "link dth-br"]
    monkeypatch.setattr(netns, "missing_requirements", lambda: None)
    monkeypatch.setattr(netns, "_namespaces", lambda net: [n.split()[1] for n in left[:2]])
    monkeypatch.setattr(netns, "namespace_pids", lambda ns: [])
    monkeypatch.setattr(netns, "leftovers", lambda net: list(left))
    monkeypatch.setattr(netns, "destroy", lambda net: (calls.append("destroy"), left.clear()))
    monkeypatch.setattr(netns, "create", lambda net: calls.append("create"))
    monkeypatch.setattr(hosts.stack, "up", lambda config, register: {})
    monkeypatch.setattr(hosts, "start_all", lambda services: calls.append("workers"))
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path))
    hosts.up(config)
    assert calls == ["destroy", "create", "workers"]


def test_up_leaves_a_cluster_with_a_process_on_a_host_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[str] = []
    monkeypatch.setattr(netns, "missing_requirements", lambda: None)
    monkeypatch.setattr(netns, "_namespaces", lambda net: ["dth1", "dth2"])
    monkeypatch.setattr(netns, "namespace_pids", lambda ns: [4242] if ns == "dth2" else [])
    monkeypatch.setattr(netns, "leftovers", lambda net: ["namespace dth1", "namespace dth2"])
    monkeypatch.setattr(netns, "destroy", lambda net: removed.append("destroy"))
    config = hosts.HostsConfig.on(tmp_path, Network(), StackConfig(root=tmp_path))
    with pytest.raises(netns.NetnsError, match="already exist: a cluster with prefix"):
        hosts.up(config)
    assert removed == []
