"""Where a machine's CPU goes while something runs (a CI run, a bench): every second, the
CPU time each process used since the last look, filed by what its command line says it is
(a Prefect server, an MLflow server, a Dask worker, a flow...); a ``multiprocessing`` child
is filed under its parent. Every 30 s, and at the end, the totals are written as JSON.

    python bench/process_cpu.py OUT.json [--seconds N]

Run it beside the work (``bash .ci/run`` in another shell), stop it with Ctrl-C. Processes
that live less than a second are partly missed; what was there when it started counts only
from then on. Figures: docs/performance.md, "CI time: where the CPU goes".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

__all__ = ["category", "main"]

TICKS = os.sysconf("SC_CLK_TCK")
WRITE_EVERY_S = 30.0

# First match wins: (a piece of the command line, the category it files the process under).
RULES = (
    ("prefect server", "prefect-server"),
    ("prefect worker", "prefect-worker"),
    ("flows.engine_session", "flow-run (stack)"),
    ("prefect.engine", "flow-run (engine)"),
    ("-m flows.experiment", "flow (embedded)"),
    ("mlflow", "mlflow"),
    ("weed", "seaweedfs"),
    ("dask_scheduler", "dask-scheduler"),
    ("dask_worker", "dask-worker"),
    ("trial_guard", "trial-guard"),
    ("forkserver", "forkserver"),
    ("det_tasks.runner", "trial-runner"),
    ("postgres", "postgres"),
    ("-m pytest", "pytest"),
    ("/bin/det ", "det"),
    ("det-tasks", "det-tasks"),
)

Key = tuple[int, str]  # pid and start time: a reused pid is another process


def category(pid: int, depth: int = 0) -> str:
    """What the process is, from its command line (a ``multiprocessing`` child: its
    parent's)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    command = raw.replace(b"\0", b" ").decode(errors="replace")
    if not command:
        return "kernel or zombie"
    if "spawn_main" in command and depth < 3:
        parent = _stat(pid)
        if parent is not None:
            return category(int(parent[1]), depth + 1)
    for piece, name in RULES:
        if piece in command:
            return name
    words = command.split()
    if "-m" in words[:-1]:
        return "python -m " + words[words.index("-m") + 1]
    return Path(words[0]).name


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _look() -> dict[Key, float]:
    """Each process's CPU seconds so far (user + system)."""
    seen: dict[Key, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None:
            continue
        seen[(int(entry), fields[19])] = (int(fields[11]) + int(fields[12])) / TICKS
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where the totals are written (JSON)")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = parser.parse_args()
    started = time.monotonic()
    last = _look()  # what ran before: counted from now on
    names: dict[Key, str] = {}
    totals: dict[str, float] = collections.defaultdict(float)
    written = started

    def write() -> None:
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])
        report = {
            "seconds": round(time.monotonic() - started),
            "cpu_seconds": {name: round(cpu, 1) for name, cpu in ranked},
        }
        args.out.write_text(json.dumps(report, indent=1))

    try:
        while args.seconds is None or time.monotonic() - started < args.seconds:
            time.sleep(1.0)
            now = _look()
            for key, cpu in now.items():
                if key not in names:
                    names[key] = category(key[0])
                totals[names[key]] += cpu - last.get(key, 0.0)
            last = now
            if time.monotonic() - written >= WRITE_EVERY_S:
                write()
                written = time.monotonic()
    except KeyboardInterrupt:
        pass
    write()
    print(args.out.read_text())


if __name__ == "__main__":
    main()
