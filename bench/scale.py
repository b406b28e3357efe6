"""How the no-server experiment scales with its number of trials (issue 30: 64 trials never
finished once workers recycled themselves after 16).

Embedded experiments (`python -m flows.experiment`, no servers: ephemeral Prefect server,
MLflow SQLite store, local Dask cluster) of the flow tests' XOR trial, random search, trials
of 2 batches, 2 at a time, default settings (workers recycled after 16 trials each), run in
one go so the figures sit side by side:

- wall: the whole command, Prefect server start and shutdown included;
- flow body / trial: from the flow's own log, "N trial(s) to start" to "summary:", per trial;
- marginal / trial: (wall - the 1-trial experiment's wall) / (N - 1);
- the MLflow SQLite file and the Prefect database (with its WAL) at the end;
- peak RSS of the whole process tree (flow, Prefect server, Dask scheduler and workers).

``--stack`` runs the same experiments on a local stack with PostgreSQL behind MLflow and
Prefect (started by ``infra.stack.up`` on ports of its own, stopped at the end): the flow
runs against the Prefect server, logs to the MLflow server and S3, and trains on the
stack's two warm Dask workers. The database sizes are then PostgreSQL's
``pg_database_size`` of each database, and the peak RSS covers every stack service too.
Needs PostgreSQL's server binaries (``initdb``).

    python bench/scale.py [--trials 16 64 256] [--with-1024] [--stack] [--timeout 3600]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flow_latency import ROOT, no_server_env  # a sibling script, not a package

CONFIG = ROOT / "tests" / "fixtures" / "flow_model" / "recycling.yaml"
# recycling.yaml is random search, 2 batches per trial, 2 at a time; only the count varies.
STAMP = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \|")
START, END = "trial(s) to start", "summary:"


@dataclasses.dataclass
class Run:
    trials: int
    wall_s: float
    body_s: float | None  # the flow's first to last line of its own work
    mlflow_db_mb: float
    prefect_db_mb: float
    peak_rss_mb: float
    returncode: int


@dataclasses.dataclass(frozen=True)
class Stack:
    """A running PostgreSQL stack: the client environment and how to size its databases."""

    env: dict[str, str]
    root: Path
    postgres_port: int


def run_experiment(trials: int, timeout_s: float, stack: Stack | None) -> tuple[Run, str]:
    """One experiment of ``trials`` trials in a fresh home (embedded, or on ``stack``); its
    figures and its stderr (the flow's log)."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        env = {**no_server_env(home), "PYTHONPATH": str(ROOT), **(stack.env if stack else {})}
        args = [sys.executable, "-m", "flows.experiment", str(CONFIG)]
        args.append(f"searcher.max_trials={trials}")
        log = home / "stderr.txt"
        before = _database_sizes_mb(stack) if stack else (0.0, 0.0)
        t0 = time.perf_counter()
        with log.open("w") as err:
            child = subprocess.Popen(args, cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=err)
            # On the stack the services are this process's children too: count them all.
            peak = _watch(child, t0 + timeout_s, psutil.Process() if stack else None)
        wall = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        if stack:
            after = _database_sizes_mb(stack)
            mlflow_mb, prefect_mb = after[0] - before[0], after[1] - before[1]
        else:
            mlflow_mb = _size_mb(home / "det", "mlflow.db*")
            prefect_mb = _size_mb(home / "prefect", "*.db*")
        run = Run(
            trials=trials,
            wall_s=wall,
            body_s=_body_seconds(text),
            mlflow_db_mb=mlflow_mb,
            prefect_db_mb=prefect_mb,
            peak_rss_mb=peak / 2**20,
            returncode=child.returncode,
        )
    return run, text


def _watch(
    child: subprocess.Popen[bytes], deadline: float, counted: psutil.Process | None = None
) -> int:
    """Wait for ``child`` (killing its tree at ``deadline``); the peak RSS of its tree, or
    of ``counted``'s whole tree when given."""
    parent = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        tree = [parent, *_children(parent)]
        measured = _children(counted) if counted else tree
        peak = max(peak, sum(_rss(p) for p in measured))
        if time.perf_counter() > deadline:
            for proc in reversed(tree):
                _kill(proc)
            child.wait()
            break
        time.sleep(0.5)
    return peak


@contextlib.contextmanager
def postgres_stack() -> Iterator[Stack]:
    """The local stack with PostgreSQL, on ports apart from `make up`'s and the tests'."""
    from infra import postgres
    from infra.stack import StackConfig, down, up

    with tempfile.TemporaryDirectory(prefix="scale-stack-") as tmp:
        config = StackConfig(
            root=Path(tmp),
            s3_port=27333,
            master_port=27334,
            volume_port=27181,
            filer_port=27989,
            mlflow_port=27001,
            prefect_port=27200,
            dask_port=27786,
            postgres_port=27432,
            seaweed_grpc_shift=-15000,
        )
        try:
            env = up(config)
            yield Stack(env=env, root=config.root, postgres_port=27432)
        finally:
            down(config)
            shutil.rmtree(postgres.data_dir(config.root).parent, ignore_errors=True)


def _database_sizes_mb(stack: Stack) -> tuple[float, float]:
    """PostgreSQL's own size of the ``mlflow`` and ``prefect`` databases, MB."""
    from infra import postgres

    sizes = postgres.database_sizes(stack.root, stack.postgres_port)
    return sizes["mlflow"] / 2**20, sizes["prefect"] / 2**20


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _rss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_info().rss)
    except psutil.Error:
        return 0


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.Error:
        pass


def _body_seconds(log: str) -> float | None:
    """Seconds from the flow's "N trial(s) to start" line to its "summary:" line."""
    start = end = None
    for line in log.splitlines():
        match = STAMP.match(line)
        if match and START in line and start is None:
            start = datetime.strptime(match.group(1), "%H:%M:%S.%f")
        elif match and END in line:
            end = datetime.strptime(match.group(1), "%H:%M:%S.%f")
    if start is None or end is None:
        return None
    return (end - start).total_seconds() % 86400  # across midnight too


def _size_mb(folder: Path, pattern: str) -> float:
    return sum(f.stat().st_size for f in folder.glob(pattern)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--with-1024", action="store_true", help="also 1,024 trials")
    parser.add_argument("--timeout", type=float, default=3600, help="per experiment, s")
    parser.add_argument(
        "--stack", action="store_true", help="on a local stack with PostgreSQL, not embedded"
    )
    args = parser.parse_args()
    counts = [*args.trials, *([1024] if args.with_1024 else [])]
    machine = f"{platform.node()} ({os.cpu_count()} CPUs), load {os.getloadavg()}"
    with postgres_stack() if args.stack else contextlib.nullcontext() as stack:
        base, _ = run_experiment(1, args.timeout, stack)
        rows = [base]
        for n in counts:
            run, log = run_experiment(n, args.timeout, stack)
            rows.append(run)
            if run.returncode != 0:
                print(f"{n} trials: exit {run.returncode}\n{log[-3000:]}", file=sys.stderr)
    mode = "stack, PostgreSQL" if args.stack else "embedded"
    print(f"{mode}; database sizes: {'growth during the run' if args.stack else 'at the end'}")
    print(
        f"{'trials':>6} {'exit':>4} {'wall s':>8} {'body/trial s':>12} {'marginal/trial s':>16}"
        f" {'mlflow MB':>9} {'prefect MB':>10} {'peak RSS MB':>11}"
    )
    for r in rows:
        body = f"{r.body_s / r.trials:.2f}" if r.body_s is not None else "-"
        marginal = f"{(r.wall_s - base.wall_s) / (r.trials - 1):.2f}" if r.trials > 1 else "-"
        print(
            f"{r.trials:>6} {r.returncode:>4} {r.wall_s:>8.1f} {body:>12} {marginal:>16}"
            f" {r.mlflow_db_mb:>9.1f} {r.prefect_db_mb:>10.1f} {r.peak_rss_mb:>11.0f}"
        )
    print(json.dumps({"machine": machine, "runs": [dataclasses.asdict(r) for r in rows]}))


if __name__ == "__main__":
    main()
