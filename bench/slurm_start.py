"""Issue 54's bench: from ``det experiment create`` to the first batch on a Slurm site whose
Dask workers are Slurm jobs (cluster.slurm_workers), cold (no worker job: one is submitted
on demand) and warm (the job of the experiment before is still granted), side by side in
one run; and what a worker job's start costs, from ``squeue`` first listing it to its worker
joining the scheduler.

It brings up its own Slurm site on namespaced hosts (infra.slurm: a controller on host 0, a
``slurmd`` on each of 2 compute hosts) and a stack on host 0 with no worker of its own, so it
needs root and Debian's slurm-wlm, as ``make test-slow``'s Slurm tests do. Each cold run first
waits for the idle worker job of the run before to be given back (the default idle minute)::

    .venv/bin/python -m bench.slurm_start [--repeats 3] [--port-offset N]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.det_latency import MODEL, Det, stack_config
from bench.flow_latency import ROOT, create_phases

__all__ = ["JobWatch", "main"]

PHASES = ("create returned", "flow run Running", "first task started", "first batch")
JOB_PHASES = ("job listed", "job running", "worker joined")


class JobWatch:
    """Polls Slurm and the scheduler every 0.1 s from its start: when a worker job is first
    listed by ``squeue``, first RUNNING, and when the stack's pool first has a worker."""

    def __init__(self, slurm_env: dict[str, str], pools: Callable[[], dict[str, int]]) -> None:
        self.slurm_env, self.pools = slurm_env, pools
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> JobWatch:
        self.t0 = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set() and len(self.seen) < len(JOB_PHASES):
            states = squeue_states(self.slurm_env)
            if states:
                self.seen.setdefault("job listed", time.time() - self.t0)
            if "RUNNING" in states:
                self.seen.setdefault("job running", time.time() - self.t0)
            if sum(self.pools().values()) >= 1:
                self.seen.setdefault("worker joined", time.time() - self.t0)
            time.sleep(0.1)


def squeue_states(slurm_env: dict[str, str]) -> list[str]:
    """The states of the site's jobs, as ``squeue`` prints them."""
    done = subprocess.run(
        ["squeue", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30,
        env={**os.environ, **slurm_env}, check=True,
    )  # fmt: skip
    return done.stdout.split()


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.5)


def _one(det: Det, env: dict[str, str], slurm_env: dict[str, str], name: str) -> dict[str, float]:
    from cluster.job_requests import cluster_pools_at

    with JobWatch(slurm_env, lambda: cluster_pools_at(env["DET_TASKS_DASK_SCHEDULER"])) as watch:
        phases = create_phases(det, env, name)
    return {**phases, **watch.seen}


def measure(repeats: int, offset: int) -> dict[str, list[dict[str, float]]]:
    """``repeats`` cold and warm experiments, alternating, on a site and stack of its own."""
    from infra import netns, slurm
    from infra.stack import down, up

    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="slurm-start-") as folder:
        root = Path(folder)
        workdir = root / "xor"
        shutil.copytree(MODEL, workdir)
        network = netns.Network(hosts=2, subnet=f"10.85.{offset // 10 % 250}", prefix="bsl")
        site = slurm.SlurmSite(
            root / "site", network, ctld_port=27821 + offset, slurmd_port=27822 + offset,
            hidden=(str(root / "stack"),),
        )  # fmt: skip
        config = slurm.stack_on_site(stack_config(root / "stack", offset), site)
        slurm_env = slurm.client_env(site)
        with slurm.running(site):
            try:
                print("starting a Slurm site and a stack (about a minute)...", file=sys.stderr)
                stack_env = up(config, register=True)
                env = {**os.environ, **stack_env, "PREFECT_HOME": str(root / "prefect-client")}
                env.pop("DET_MASTER", None)
                det = Det("this tree", ROOT, env, workdir)
                for i in range(repeats + 1):  # the first cold/warm pair warms up, not counted
                    _until(lambda: not squeue_states(slurm_env), 240, "idle worker job released")
                    for kind in ("cold", "warm"):
                        row = _one(det, env, slurm_env, f"bench-slurm-{kind}-{os.getpid()}-{i}")
                        if i:
                            rows[kind].append(row)
            finally:
                down(config)
    return rows


def _cell(runs: list[dict[str, float]], phase: str) -> str:
    values = [r[phase] for r in runs if phase in r]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port-offset", type=int, default=0)
    args = parser.parse_args(argv)
    before = os.getloadavg()[0]
    rows = measure(args.repeats, args.port_offset)
    print(f"load average (1 min) before {before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{platform.node()} ({os.cpu_count()} CPUs); medians of {args.repeats}, seconds "
          "from `det experiment create`")  # fmt: skip
    for phase in PHASES:
        print(f"{phase}: cold {_cell(rows['cold'], phase)}; warm {_cell(rows['warm'], phase)}")
    for phase in JOB_PHASES:  # warm: the job was there before the create
        print(f"{phase} (cold): {_cell(rows['cold'], phase)}")
    starts = [r["worker joined"] - r["job listed"] for r in rows["cold"] if "job listed" in r]
    if starts:
        spread = f"{min(starts):.2f}-{max(starts):.2f}"
        median = statistics.median(starts)
        print(
            f"a worker job's start (squeue lists it -> its worker joins): {median:.2f} s ({spread})"
        )


if __name__ == "__main__":
    main()
