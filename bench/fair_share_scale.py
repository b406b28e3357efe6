"""The fair-share scheduler's decision time at scale (issue 53, item 5): 50 experiments and
500 queued trials on 16 workers, simulated against the real job queue plugin
(cluster.job_queue.JobQueue) on a real Dask scheduler in this process
(``LocalCluster(processes=False)`` with 16 workers: the plugin counts their slots as on the
stack).

Every experiment (10 trials each; weights 1, 2 or 3; every fifth at priority 20, the rest
at Determined's default 42; 2-4 at a time) asks the queue for its trials, as a flow does at
each wake-up; then, until every trial has run, a running trial ends (the oldest first, a
simulated trial length) and its experiment asks again, and every experiment that waits asks
too, as the flows' wake-ups would. Preemptions are obeyed (the trial goes back to waiting).
Printed, one line per figure: the time of one decision (``JobQueue.sync``, the plugin's
own work: median and p95 over every sync), the same asked as a flow asks it (Dask RPC from
a client), and ``det job list``'s HTTP request with the 50 jobs queued.

    python bench/fair_share_scale.py [--experiments 50] [--trials 10] [--workers 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figure(scale: str, label: str, seconds: list[float]) -> None:
    """One line: the median and p95 of ``seconds``, in milliseconds."""
    ms = [t * 1000 for t in seconds]
    print(f"fair share, {scale}: {label}: median {statistics.median(ms):.2f} ms, "
          f"p95 {percentile(ms, 0.95):.2f} ms, n={len(ms)}")  # fmt: skip


class Experiment:
    """One simulated flow: its job report, its waiting and running trials."""

    def __init__(self, n: int, trials: int) -> None:
        self.key = f"{n:04d}-bench-experiment"
        self.job = {
            "name": f"bench-{n}",
            "user": "bench",
            "pool": "default",
            "need": 1,
            "max_trials": 2 + n % 3,
            "priority": 20 if n % 5 == 0 else 42,
            "weight": float(1 + n % 3),
            "client": f"client-{n}",
        }
        self.waiting = list(range(1, trials + 1))
        self.running: dict[int, int] = {}  # trial -> the simulated tick it started
        self.done = 0

    def wanted(self) -> list[int]:
        room = self.job["max_trials"] - len(self.running)  # type: ignore[operator]
        return self.waiting[: max(0, room)]

    def apply(self, answer: dict[str, Any], tick: int) -> None:
        for trial in answer["grants"]:
            self.waiting.remove(trial)
            self.running[trial] = tick
        for trial in answer["preempt"]:
            if self.running.pop(trial, None) is not None:
                self.waiting.insert(0, trial)


def simulate(queue: Any, experiments: list[Experiment], rpc: Any) -> dict[str, list[float]]:
    """Run every trial once through the queue; the seconds each sync took."""
    times: dict[str, list[float]] = {"sync": [], "rpc": []}
    tick = 0

    def ask(exp: Experiment, through_rpc: bool) -> None:
        args = (exp.key, exp.job, exp.wanted(), sorted(exp.running))
        start = time.perf_counter()
        answer = rpc(*args) if through_rpc else queue.sync(*args)
        times["rpc" if through_rpc else "sync"].append(time.perf_counter() - start)
        exp.apply(answer, tick)

    for exp in experiments:
        ask(exp, False)
    while any(e.waiting or e.running for e in experiments):
        tick += 1
        running = [(started, e, t) for e in experiments for t, started in e.running.items()]
        if running:
            _, ending, trial = min(running, key=lambda r: (r[0], r[1].key, r[2]))
            del ending.running[trial]
            ending.done += 1
            ask(ending, tick % 10 == 0)  # every tenth through Dask's RPC, as a flow asks
        for exp in experiments:
            if exp.wanted():
                ask(exp, False)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=50)
    parser.add_argument("--trials", type=int, default=10, help="per experiment")
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()

    import logging

    import dask.config
    from distributed import Client, LocalCluster

    from cluster import job_requests
    from cluster.job_queue import JOB_QUEUE_NAME, JobQueue
    from cluster.queue_http import ROUTES_SETTING, route_modules

    logging.getLogger("distributed").setLevel(logging.ERROR)
    before = os.getloadavg()

    with (
        dask.config.set({ROUTES_SETTING: route_modules()}),
        LocalCluster(
            n_workers=args.workers,
            processes=False,
            threads_per_worker=1,
            dashboard_address="127.0.0.1:0",
        ) as cluster,  # fmt: skip
        Client(cluster) as client,
    ):
        client.register_plugin(JobQueue(), name=JOB_QUEUE_NAME)
        queue = cluster.scheduler.plugins[JOB_QUEUE_NAME]
        queue.min_runtime_s = 0.0  # simulated trials: preemption may act at once

        def rpc(key: str, job: dict[str, Any], waiting: list[int], running: list[int]) -> Any:
            handler = client.scheduler.det_jobs_sync
            return client.sync(handler, key=key, job=job, waiting=waiting, running=running)

        experiments = [Experiment(n, args.trials) for n in range(args.experiments)]
        # Everyone queued, nobody started: what `det job list` reads at the peak.
        os.environ[job_requests.HTTP_ENV] = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        for exp in experiments:
            queue.preregister(exp.key, exp.job)
        listing = []
        for _ in range(20):
            start = time.perf_counter()
            jobs = job_requests.list_jobs("tcp://unused:1")
            listing.append(time.perf_counter() - start)
        assert len(jobs) == args.experiments, len(jobs)
        times = simulate(queue, experiments, rpc)
        assert all(e.done >= args.trials for e in experiments)
    after = os.getloadavg()
    total = args.experiments * args.trials
    scale = f"{args.experiments} experiments, {total} trials, {args.workers} workers"
    machine = f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"machine: {machine}; load before {before[0]:.2f}, after {after[0]:.2f}")
    figure(scale, "decision (JobQueue.sync)", times["sync"])
    figure(scale, "sync through Dask RPC (a flow's wake-up)", times["rpc"])
    figure(scale, f"det job list over HTTP ({args.experiments} jobs)", listing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
