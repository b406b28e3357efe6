"""A real Slurm site on namespaced hosts (infra/slurm.py): the controller on host 0, a
``slurmd`` on each compute host with its own address and hostname, MUNGE between them; a
job runs where Slurm places it, bad input is refused by Slurm itself, and ``down`` leaves
nothing behind."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import netns, slurm
from tests.integration.hosts_helpers import prefix

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        slurm.missing_requirements() is not None, reason=str(slurm.missing_requirements())
    ),
]

_OFFSET = int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0"))


def site_for(root: Path) -> slurm.SlurmSite:
    """A site of this checkout's own: a subnet, names and controller port apart from the
    multi-host tests' and from another checkout testing at once."""
    network = netns.Network(hosts=2, subnet=f"10.80.{_OFFSET // 10 % 250}", prefix=prefix("s"))
    return slurm.SlurmSite(root, network, ctld_port=26817 + _OFFSET, slurmd_port=26818 + _OFFSET)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.SlurmSite]:
    config = site_for(tmp_path_factory.mktemp("slurm"))
    with slurm.running(config):
        yield config


def _run(site: slurm.SlurmSite, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=site.scratch,
        env={**os.environ, **slurm.client_env(site)},
    )  # fmt: skip


def test_every_node_serves_and_a_job_runs_on_each_host_at_its_own_address(
    site: slurm.SlurmSite,
) -> None:
    assert slurm.node_states(site) == {name: "idle" for name in site.nodes}
    done = _run(
        site, "srun", "--nodes=2", "--ntasks=2", "sh", "-c", "echo $(hostname) $(hostname -I)"
    )
    assert done.returncode == 0, done.stderr
    seen = {tuple(line.split()) for line in done.stdout.splitlines()}
    assert seen == {(site.node_name(h), site.network.address(h)) for h in (1, 2)}


def test_a_batch_job_writes_its_output_to_the_shared_scratch(site: slurm.SlurmSite) -> None:
    out = site.scratch / "job.out"
    done = _run(
        site, "sbatch", "--wait", f"--output={out}", "--nodelist", site.node_name(2),
        "--wrap", "echo on $(hostname) as job $SLURM_JOB_ID",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[-1]
    assert out.read_text().split() == ["on", site.node_name(2), "as", "job", job_id]


def test_slurm_itself_refuses_an_unknown_partition(site: slurm.SlurmSite) -> None:
    done = _run(site, "sbatch", "--test-only", "--partition=nope", "--wrap", "true")
    assert done.returncode != 0
    assert "invalid partition" in done.stderr.lower()


def test_down_leaves_no_process_and_no_host(tmp_path: Path) -> None:
    """A second site (its own subnet and names) brought up and down again."""
    network = netns.Network(
        hosts=1, subnet=f"10.80.{(_OFFSET // 10 + 1) % 250}", prefix=prefix("r")
    )
    config = slurm.SlurmSite(
        tmp_path, network, ctld_port=26819 + _OFFSET, slurmd_port=26820 + _OFFSET
    )
    with slurm.running(config):
        assert slurm.node_states(config) == {config.node_name(1): "idle"}
        leader = int((tmp_path / "pids" / "slurmctld.pid").read_text())
    assert netns.leftovers(network) == []
    with pytest.raises(ProcessLookupError):
        os.kill(leader, 0)
