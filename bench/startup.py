"""Start-up cost of the no-server experiment (`python -m flows.experiment CONFIG`), issue 24.

Runs the 1-batch single-trial MNIST flow as a whole command in a fresh home (a new
DET_TASKS_HOME and PREFECT_HOME each time: the Prefect and MLflow schemas are created) and
in a warm home (both already made by a first run, which is not counted), interleaved,
median of ``--repeats`` each, and splits each run's wall from the flow's own log
timestamps:

- imports: process start -> Prefect's "Starting temporary server" line (with the server
  prestarted there is no such line: all of start-up is then counted here)
- server: -> "Beginning flow run" (server ready, flow run created)
- flow: -> the flow run's "Finished in state" line (its first step's own work apart)
- shutdown: -> process exit

A third column, "services", runs in a warm home whose warm services are up
(``python -m infra.warm_home start``, started once, not counted): the run attaches to their
Prefect server and Dask workers instead of starting its own.

Targets (issue 24): <= 10 s warm, <= 15 s fresh. The host's load is printed beside the
figures: on a shared machine compare only figures from the same run.

``--floor`` (issue 53, item 2) instead runs Prefect's own one-task flow (``FLOOR_FLOW``: one
trivial task on the ephemeral server Prefect starts itself) against the 1-batch run above,
both whole processes in warm homes, interleaved, and prints one line per figure: each
wall's median, their ratio (target <= 1.3) and the 1-batch run's phases.

    python bench/startup.py [--repeats 3] [--floor [--baseline-src DIR]]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flow_latency import no_server_env, run_in_home
from flows.embedded import PRESTART_ENV

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "mnist" / "const.yaml"
ONE_BATCH = ["searcher.max_length={batches: 1}", "min_validation_period={batches: 1}"]
STAMP = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+ +\| (.*)$")
FIRST_STEP = re.compile(r"trained to batch \d+ on \S+ \((?:warm|restored from [^,]+), ([\d.]+) s\)")
PHASES = ("imports", "server", "flow", "first step", "shutdown", "wall")
# Prefect's floor: the least a flow run costs as a whole process on its ephemeral server.
FLOOR_FLOW = """
from prefect import flow, task
@task
def one() -> int:
    return 1
@flow
def floor() -> int:
    return one()
floor()
"""


def _clock(text: str, day: datetime) -> float:
    """A log line's HH:MM:SS.mmm as seconds since the epoch: on the run's start day, or
    the next one for a run that crossed midnight."""
    t = datetime.strptime(text, "%H:%M:%S.%f").time()
    at = datetime.combine(day.date(), t)
    if at < day - timedelta(hours=1):
        at += timedelta(days=1)
    return at.timestamp()


def run_once(home: Path, prestart: bool = True, src: Path = ROOT) -> dict[str, float]:
    """One whole command in ``home``, run from the source tree ``src``; its wall and phases
    in seconds. ``prestart=False``: Prefect starts its ephemeral server itself (the
    behaviour before issue 24)."""
    t0 = time.time()
    day = datetime.now()
    env = {PRESTART_ENV: str(int(prestart)), "PYTHONPATH": str(src)}
    done = run_in_home(home, "flows.experiment", str(CONFIG), *ONE_BATCH, env=env)
    t_end = time.time()
    if done.returncode:
        sys.exit(f"the flow failed ({done.returncode}):\n{done.stderr[-4000:]}")
    marks: dict[str, float] = {}
    first_step = float("nan")
    for line in done.stderr.splitlines():
        match = STAMP.match(line)
        if not match:
            continue
        at, text = _clock(match.group(1), day), match.group(2)
        if "Starting temporary server" in text:
            marks.setdefault("server_start", at)
        elif "Beginning flow run" in text:
            marks.setdefault("flow_start", at)
        elif text.startswith("Flow run") and "Finished in state" in text:
            marks["flow_end"] = at
        elif step := FIRST_STEP.search(text):
            first_step = float(step.group(1)) if math.isnan(first_step) else first_step
    server_start = marks.get("server_start", marks["flow_start"])
    return {
        "imports": server_start - t0,
        "server": marks["flow_start"] - server_start,
        "flow": marks["flow_end"] - marks["flow_start"],
        "first step": first_step,
        "shutdown": t_end - marks["flow_end"],
        "wall": t_end - t0,
    }


def _warm_services(home: Path, command: str) -> None:
    """``python -m infra.warm_home start|stop`` for ``home`` (as run_once sees it)."""
    done = run_in_home(home, "infra.warm_home", command)
    if done.returncode:
        sys.exit(f"warm services {command} failed:\n{done.stderr[-4000:]}")


def floor_once(home: Path) -> float:
    """Prefect's one-task flow as a whole process in ``home``: its wall in seconds."""
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-c", FLOOR_FLOW], cwd=home, env=no_server_env(home), capture_output=True
    )
    if done.returncode:
        sys.exit(f"Prefect's one-task flow failed ({done.returncode}):\n{done.stderr[-4000:]!r}")
    return time.time() - t0


def against_the_floor(repeats: int, baseline: Path | None = None) -> None:
    """Issue 53 item 2: the 1-batch run against Prefect's own one-task flow, warm homes,
    interleaved; one line per figure. ``baseline``: another source tree's 1-batch run
    (``git archive COMMIT | tar -x -C DIR``) interleaved with them, in a home of its own."""
    load_before = os.getloadavg()[0]
    trees = {"this tree": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    ours: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    floor: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        homes = {name: Path(tmp) / f"ours-{i}" for i, name in enumerate(trees)}
        floor_home = Path(tmp) / "floor"
        for home in [*homes.values(), floor_home]:
            home.mkdir()
        for name, src in trees.items():  # warm the homes; not counted
            run_once(homes[name], src=src)
        floor_once(floor_home)
        for _ in range(repeats):
            for name, src in trees.items():
                ours[name].append(run_once(homes[name], src=src))
            floor.append(floor_once(floor_home))
    floor_s = statistics.median(floor)
    walls = [round(f, 2) for f in floor]
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"prefect one-task flow, warm home, median of {repeats}: {floor_s:.2f} s {walls}")
    for name, runs in ours.items():
        wall = statistics.median(r["wall"] for r in runs)
        each = [round(r["wall"], 2) for r in runs]
        print(f"1-batch flows.experiment ({name}), warm home: {wall:.2f} s {each}")
        print(f"ratio ({name}; target <= 1.3): {wall / floor_s:.3f}")
        for phase in PHASES[:-1]:
            print(f"  {name} {phase}: {statistics.median(r[phase] for r in runs):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="against Prefect's own flow")
    parser.add_argument("--baseline-src", type=Path, help="--floor: another tree beside it")
    args = parser.parse_args()
    if args.floor:
        against_the_floor(args.repeats, args.baseline_src)
        return
    load_before = os.getloadavg()[0]
    columns = [(home, prestart) for home in ("fresh", "warm") for prestart in (True, False)]
    columns.append(("services", True))
    results: dict[tuple[str, bool], list[dict[str, float]]] = {c: [] for c in columns}
    with tempfile.TemporaryDirectory() as tmp:
        for prestart in (True, False):  # make each warm home; not counted
            (Path(tmp) / f"warm-{prestart}").mkdir()
            run_once(Path(tmp) / f"warm-{prestart}", prestart)
        services_home = Path(tmp) / "services"
        services_home.mkdir()
        _warm_services(services_home, "start")
        try:
            run_once(services_home)  # the home's MLflow schema and first import; not counted
            for i in range(args.repeats):
                for home, prestart in columns:
                    where = Path(tmp) / (
                        f"fresh-{prestart}-{i}"
                        if home == "fresh"
                        else "services"
                        if home == "services"
                        else f"warm-{prestart}"
                    )
                    where.mkdir(exist_ok=True)
                    results[home, prestart].append(run_once(where, prestart))
        finally:
            _warm_services(services_home, "stop")
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"median of {args.repeats}, seconds; 'off' = {PRESTART_ENV}=0 (Prefect starts it)")
    print(f"{'phase':<12}" + "".join(f"{h + (' on' if p else ' off'):>13}" for h, p in columns))
    for phase in PHASES:
        cells = [statistics.median(r[phase] for r in results[c]) for c in columns]
        print(f"{phase:<12}" + "".join(f"{c:>13.2f}" for c in cells))
    walls = {
        f"{h} {'on' if p else 'off'}": [round(r["wall"], 1) for r in results[h, p]]
        for h, p in columns
    }
    print(f"walls: {walls}; targets: fresh <= 15 s, warm <= 10 s ('services on': warm home,")
    print("warm services up: python -m infra.warm_home start)")


if __name__ == "__main__":
    main()
