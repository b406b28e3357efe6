"""How long each ``det`` verb a user types takes (issues 41 and 53: every one within a
second on an idle machine, ``det --help`` within 0.3 s).

Starts a stack of its own (SeaweedFS, MLflow, Prefect server and worker, Dask; on ports of
its own, in a temporary folder, stopped at the end) or uses a running one (``--stack-dir``,
what ``make up`` made), creates an experiment of the flow tests' XOR trial (slowed to keep
training), and times whole ``det`` commands as a shell runs them, ``det --help`` (start-up
and parsing only) as the floor:

- the verbs that read or set a value (``reads``: ``det --help``, ``experiment list``,
  ``describe``, ``list-trials``, ``list-checkpoints``, ``logs``, ``set weight``,
  ``trial describe``, ``job list``, ``job update``, ``model list``): ``--runs`` times each;
- ``det experiment create``: once per experiment made;
- ``det experiment pause ID`` and ``activate ID``: ``--runs`` cycles (each waits until the
  flow run is paused, then running again, before the next command; the waits are not
  timed);
- ``det experiment kill ID``: once per experiment, on ``--kills`` experiments.

With ``--baseline-src DIR`` (another checkout, e.g. ``git archive HEAD | tar -x -C DIR``)
every command also runs from that tree, interleaved with this one's, in the same run: the
two columns are comparable. Prints medians (and the spread) per verb, the machine and its
load before and after.

    python bench/det_latency.py [--runs 5] [--kills 3] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.stack import StackConfig, down, env_for, up  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "flow_model"
# Slow and long: it trains (lightly: it sleeps) for as long as the bench needs it.
SLOW = [
    "--config",
    "hyperparameters.sleep_s=0.2",
    "--config",
    "searcher.max_length={batches: 100000}",
]
# Ports apart from a `make up` stack's and the tests' (tests/integration/helpers.py).
PORT_BASE = {"s3": 38333, "master": 39334, "volume": 38181, "filer": 38989, "mlflow": 35001,
             "prefect": 34200, "dask": 38786}  # fmt: skip


def stack_config(root: Path, offset: int) -> StackConfig:
    return StackConfig(
        root=root,
        s3_port=PORT_BASE["s3"] + offset,
        master_port=PORT_BASE["master"] + offset,
        volume_port=PORT_BASE["volume"] + offset,
        filer_port=PORT_BASE["filer"] + offset,
        mlflow_port=PORT_BASE["mlflow"] + offset,
        prefect_port=PORT_BASE["prefect"] + offset,
        dask_port=PORT_BASE["dask"] + offset,
        seaweed_grpc_shift=-22000,
    )


@contextmanager
def a_stack(args: argparse.Namespace, tmp: Path) -> Iterator[dict[str, str]]:
    """The client environment of the stack the bench talks to."""
    if args.stack_dir:
        os.environ["DET_TASKS_STACK_DIR"] = str(args.stack_dir)
        yield env_for(StackConfig.from_env())
        return
    config = stack_config(tmp / "stack", args.port_offset)
    try:
        print("starting a stack of its own (about a minute)...", file=sys.stderr)
        env = up(config, register=True)
        yield env
    finally:
        down(config)


@contextmanager
def xor_stack(prefix: str, port_offset: int) -> Iterator[tuple[dict[str, str], Path]]:
    """A stack of the bench's own and a copy of the XOR model to create experiments from:
    (the client environment, the model's folder)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        tmp = Path(folder)
        workdir = tmp / "xor"
        shutil.copytree(MODEL, workdir)
        stack_args = argparse.Namespace(stack_dir=None, port_offset=port_offset)
        with a_stack(stack_args, tmp) as stack_env:
            env = {**os.environ, **stack_env, "PREFECT_HOME": str(tmp / "prefect-client")}
            env.pop("DET_MASTER", None)
            yield env, workdir


class Det:
    """Runs ``det ARGS`` from one source tree (this checkout, or the baseline's)."""

    def __init__(self, name: str, src: Path, env: dict[str, str], cwd: Path) -> None:
        self.name, self.src, self.cwd = name, src, cwd
        self.env = {**env, "PYTHONPATH": str(src)}
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}  # user + system seconds of the command

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        code = "from det_cli import command; command()"
        return subprocess.run(
            [sys.executable, "-c", code, *argv],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def timed(self, verb: str, *argv: str) -> str:
        """``det ARGV``, its wall time (and CPU time) kept under ``verb``; a failure stops
        the bench."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = self.run(*argv)
        took = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        self.cpu.setdefault(verb, []).append(cpu)
        if done.returncode != 0:
            raise RuntimeError(
                f"{self.name}: det {' '.join(argv)} exited {done.returncode}\n"
                f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        self.times.setdefault(verb, []).append(took)
        return done.stdout


def prefect_get(env: dict[str, str], path: str, body: dict[str, object] | None = None) -> object:
    """A Prefect REST call (the bench's own waits import no client)."""
    import json
    import urllib.request

    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def flow_state(env: dict[str, str], flow_run_id: str) -> str:
    run = prefect_get(env, f"/flow_runs/{flow_run_id}")
    assert isinstance(run, dict)
    return str(run["state_type"])


def full_id(env: dict[str, str], short: str) -> str:
    runs = prefect_get(env, "/flow_runs/filter", {"limit": 200, "sort": "START_TIME_DESC"})
    assert isinstance(runs, list)
    return next(str(r["id"]) for r in runs if str(r["id"]).startswith(short))


def in_state(env: dict[str, str], flow_run_id: str, state: str) -> bool:
    return flow_state(env, flow_run_id) == state


def trains_past(det: Det, short: str, batches: int) -> bool:
    return trained(det, short) > batches


def until(check: Callable[[], Any], timeout: float, what: str, every_s: float = 0.5) -> Any:
    """``check()``'s first true value, asked every ``every_s``; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every_s)
    return value


def trained(det: Det, short: str) -> int:
    """Batches trial 1 has trained, as ``det experiment list-trials`` says (0: none yet)."""
    done = det.run("experiment", "list-trials", short)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) < 3:
        return 0
    column = lines[0].split().index("batches")
    return int(lines[2].split()[column])


def create(det: Det, env: dict[str, str], name: str) -> tuple[str, str]:
    """A new experiment whose trial has trained a batch: (short id, flow-run id)."""
    out = det.timed("experiment create", "experiment", "create", "killable.yaml", ".", "--config",
                    f"name={name}", *SLOW)  # fmt: skip
    short = next(line for line in out.splitlines() if line.startswith("Created ")).split()[-1]
    until(lambda: trained(det, short) > 0, 300, f"experiment {name} trains")
    return short, full_id(env, short)


def reads(short: str) -> list[list[str]]:
    """Each verb that reads (or sets a value) and returns at once: [its label, *argv]."""
    return [
        ["--help", "--help"],
        ["experiment list", "experiment", "list"],
        ["experiment describe", "experiment", "describe", short],
        ["experiment list-trials", "experiment", "list-trials", short],
        ["experiment list-checkpoints", "experiment", "list-checkpoints", short],
        ["experiment logs", "experiment", "logs", short],
        ["experiment set weight", "experiment", "set", "weight", short, "1"],
        ["trial describe", "trial", "describe", f"{short}/1"],
        ["job list", "job", "list"],
        ["job update", "job", "update", short, "--priority", "42"],
        ["model list", "model", "list"],
    ]


def measure(dets: list[Det], env: dict[str, str], runs: int, kills: int) -> None:
    main = dets[0]
    short, run_id = create(main, env, f"bench-det-{os.getpid()}")
    for _ in range(runs):
        for det in dets:
            for verb, *argv in reads(short):
                det.timed(verb, *argv)
    for _ in range(runs):
        for det in dets:
            det.timed("experiment pause", "experiment", "pause", short)
            until(partial(in_state, env, run_id, "PAUSED"), 300, "pause")
            det.timed("experiment activate", "experiment", "activate", short)
            until(partial(trains_past, main, short, trained(main, short)), 300, "training")
    main.run("experiment", "kill", short)
    for i in range(kills):
        for det in dets:
            victim, victim_id = create(main, env, f"bench-kill-{os.getpid()}-{i}")
            det.timed("experiment kill", "experiment", "kill", victim)
            until(partial(in_state, env, victim_id, "CANCELLED"), 300, "kill")


def report(dets: list[Det], loads: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    """Per verb and tree: the median wall time (min-max, runs) and the median CPU time
    (user + system: what the command itself costs, which a busy host changes far less)."""
    verbs = list(dict.fromkeys(verb for det in dets for verb in det.times))
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("load average (1, 5, 15 min): before "
          + ", ".join(f"{x:.1f}" for x in loads[0]) + "; after "
          + ", ".join(f"{x:.1f}" for x in loads[1]))  # fmt: skip
    print(
        f"{'command':<34}" + "".join(f"{d.name + ': wall s (min-max) n, cpu s':>44}" for d in dets)
    )
    for verb in verbs:
        cells = []
        for det in dets:
            times, cpu = det.times.get(verb, []), det.cpu.get(verb, [])
            if not times:
                cells.append(f"{'-':>44}")
                continue
            text = (
                f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) "
                f"n={len(times)}, cpu {statistics.median(cpu):.2f}"
            )
            cells.append(f"{text:>44}")
        print(f"{'det ' + verb:<34}" + "".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each verb (default 5)")
    parser.add_argument("--kills", type=int, default=3, help="experiments killed (default 3)")
    parser.add_argument("--baseline-src", type=Path, help="another tree to time beside this")
    parser.add_argument("--stack-dir", type=Path, help="a running stack's folder (make up's)")
    parser.add_argument("--port-offset", type=int, default=0, help="shift the stack's ports")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="det-latency-") as folder:
        tmp = Path(folder)
        workdir = tmp / "xor"
        shutil.copytree(MODEL, workdir)
        with a_stack(args, tmp) as stack_env:
            env = {**os.environ, **stack_env, "PREFECT_HOME": str(tmp / "prefect-client")}
            env.pop("DET_MASTER", None)
            dets = [Det("this tree", ROOT, env, workdir)]
            if args.baseline_src:
                dets.append(Det("baseline", args.baseline_src.resolve(), env, workdir))
            before = os.getloadavg()
            measure(dets, env, args.runs, args.kills)
            report(dets, (before, os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
