"""examples/mnist/adaptive.yaml against Ray Tune 2.60 running the same search, side by side in
one run (issue 14, target row 2: our wall <= Ray Tune's).

- ours: ``python -m flows.experiment examples/mnist/adaptive.yaml`` with no servers
  configured, as bench/flow_latency.py runs its flows (embedded Prefect server, MLflow
  SQLite store, a Dask cluster of 2 single-threaded workers; MLflow's system-metrics
  sampler off, as in every bench's timing path; Ray Tune samples nothing either).
- Ray Tune: bench/ray_adaptive_trial.py under Ray's own venv: the example's own trial
  class (same CNN, digits data, space, 16 trials), ``ASHAScheduler(time_attr="batches",
  max_t=200, grace_period=12, reduction_factor=4)`` (rungs 12/48/192), 2 trials at a time
  on ``ray.init(num_cpus=2)``, a full validation and a model + optimizer checkpoint at each
  report (the rungs and batch 200), each trial on half of the cores, as each of our
  two Dask workers (``det_tasks.cpu_threads``; one thread each on a 2-core host).
  Timed as the whole process, from before ``ray.init`` and after it (the issue's 53 s).

- ours on warm services: the same command in a home whose warm services are up
  (``python -m infra.warm_home start``, started once and warmed by a 1-batch run, neither
  counted): the counterpart of Ray's time after ``ray.init``, whose cluster start it
  leaves out.

Our search is Determined's adaptive_asha (standard mode: brackets of 3 and 2 rungs, rungs at
12/50/200 batches), Ray's a single ASHA bracket: the same budget, not the same schedule.

Ray is not a project dependency: the first run makes ``~/.cache/det_tasks/bench-ray-venv``
(``python -m venv``) and pip-installs ``ray[tune]==2.60.0`` there with torch, scikit-learn
and det_tasks' core dependencies pinned to the versions in this venv (torch from the same
pip configuration that installed ours); the repo itself comes in through PYTHONPATH. Later
runs reuse it while those pins are unchanged. Repeats are interleaved; figures are medians.

    python bench/adaptive_vs_ray.py [--repeats 1] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Helpers from the benches beside this one, imported by name: bench/ is not under the
# project's mypy (make typecheck covers the packages) and those modules do not pass it, so
# `mypy bench/adaptive_vs_ray.py` checks this file without following them.
_flow_latency = importlib.import_module("flow_latency")  # its no-server env and paths
cpu_name = importlib.import_module("harness_overhead").cpu_name
ROOT: Path = _flow_latency.ROOT
MNIST: Path = _flow_latency.MNIST
run_in_home = _flow_latency.run_in_home

RAY = "ray[tune]==2.60.0"
RAY_VENV = Path.home() / ".cache" / "det_tasks" / "bench-ray-venv"
RAY_TRIAL = Path(__file__).resolve().with_name("ray_adaptive_trial.py")
CONFIG = MNIST / "adaptive.yaml"
FULL = {"samples": 16, "max_t": 200, "grace_period": 12}
SMOKE = {"samples": 4, "max_t": 8, "grace_period": 2}
TIMES = ("wall_s", "import_s", "init_s", "from_ray_init_s", "after_ray_init_s")


def pinned_requirements() -> list[str]:
    """Ray, plus det_tasks' core and ``examples`` requirements at this venv's versions."""
    pins = [RAY]
    for requirement in importlib.metadata.requires("det-tasks") or []:
        spec, _, marker = requirement.partition(";")
        if marker and "examples" not in marker:
            continue
        match = re.match(r"[A-Za-z0-9_.-]+", spec)
        assert match is not None, requirement
        pins.append(f"{match.group(0)}=={importlib.metadata.version(match.group(0))}")
    return pins


def ray_python() -> Path:
    """The Ray venv's python, made (or remade, when the pins changed) first if need be."""
    python, stamp = RAY_VENV / "bin" / "python", RAY_VENV / ".bench-pins"
    pins = pinned_requirements()
    if python.exists() and stamp.exists() and stamp.read_text() == "\n".join(pins):
        return python
    print(f"installing {' '.join(pins)} into {RAY_VENV} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(RAY_VENV)], check=True)
    pip = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", *pins], capture_output=True, text=True
    )
    if pip.returncode:  # its output is long and noisy (the index's warnings) only then shown
        sys.exit(f"pip install into {RAY_VENV} failed:\n{(pip.stdout + pip.stderr)[-4000:]}")
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    print(
        f"installed in {time.perf_counter() - started:.0f} s; pip check: "
        f"{check.stdout.strip() or check.stderr.strip()}",
        file=sys.stderr,
        flush=True,
    )
    stamp.write_text("\n".join(pins))
    return python


def trained_batches(home: Path, summary: dict[str, Any]) -> int:
    """Batches our run trained, summed over its trials (each trial run's progress/batches
    in the home's MLflow store): ASHA's promotions decide it, so it is counted, not assumed."""
    from det_tasks.home import no_server_recording
    from registry.runs.tracking import client_for

    client = client_for(no_server_recording(home / "det")["MLFLOW_TRACKING_URI"])
    experiment_id, parent = re.findall(
        r"experiments/(\d+)/runs/([0-9a-f]{32})", summary["mlflow_parent_run"]
    )[0]
    trials = client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'"
    )
    return sum(int(run.data.metrics.get("progress/batches", 0)) for run in trials)


def _ours_in(home: Path, smoke: bool, on_warm_services: bool) -> dict[str, float]:
    started = time.perf_counter()
    done = run_in_home(home, "flows.experiment", str(CONFIG), *_overrides(smoke))
    wall = time.perf_counter() - started
    if done.returncode or on_warm_services != ("on the warm services of" in done.stderr):
        sys.exit(f"our flow failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout)  # the flow's stdout is its summary JSON alone
    return {
        "wall_s": wall,
        "best_validation_error": summary["best"]["metric"],
        "batches_trained": trained_batches(home, summary),
    }


def ours(smoke: bool) -> dict[str, float]:
    """The no-server flow in a fresh home (flow_latency's way): wall seconds, best
    validation_error, batches trained."""
    with tempfile.TemporaryDirectory() as home:
        return _ours_in(Path(home), smoke, on_warm_services=False)


def _overrides(smoke: bool) -> list[str]:
    return (
        [f"searcher.max_trials={SMOKE['samples']}", f"searcher.max_time={SMOKE['max_t']}"]
        if smoke
        else []  # the YAML as it is: 16 trials, max_time 200
    )


def warm_services(home: Path) -> None:
    """Start ``home``'s warm services and warm them with a 1-batch run (neither timed)."""
    for command in (
        ("infra.warm_home", "start"),
        ("flows.experiment", str(MNIST / "const.yaml"), "searcher.max_length={batches: 1}"),
    ):
        done = run_in_home(home, *command)
        if done.returncode:
            sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")


def ray_tune(python: Path, smoke: bool) -> dict[str, Any]:
    """Wall seconds of the Ray Tune process, and what it reported (see ray_adaptive_trial)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env |= {"PYTHONPATH": f"{ROOT}{os.pathsep}{MNIST}", "RAY_USAGE_STATS_ENABLED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        done = subprocess.run(
            [python, RAY_TRIAL, json.dumps(SMOKE if smoke else FULL)],
            cwd=tmp,
            env={**env, "TMPDIR": tmp},
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"Ray Tune failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    if result["trial_errors"]:
        sys.exit(f"Ray Tune trials failed: {result['trial_errors']}")
    return {"wall_s": wall, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="4 trials of at most 8 batches")
    args = parser.parse_args()
    python = ray_python()
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "warm": [], "ray": []}
    with tempfile.TemporaryDirectory() as home:
        warm_services(Path(home))
        try:
            for _ in range(args.repeats):  # interleaved, so load changes hit all alike
                runs["ours"].append(ours(args.smoke))
                runs["warm"].append(_ours_in(Path(home), args.smoke, on_warm_services=True))
                runs["ray"].append(ray_tune(python, args.smoke))
        finally:
            run_in_home(Path(home), "infra.warm_home", "stop")
    load_end = os.getloadavg()
    _report(runs, args.smoke, args.repeats, load_start, load_end)


def _print_setting(
    smoke: bool,
    repeats: int,
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
) -> None:
    sizes = SMOKE if smoke else FULL
    print(
        f"machine: {platform.node()} {cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end (shared with other work)"
    )
    print(
        f"{CONFIG.relative_to(ROOT)}{' (smoke)' if smoke else ''}: {sizes['samples']} "
        f"trials, max {sizes['max_t']} batches, ASHA grace {sizes['grace_period']} / factor 4, "
        f"2 at a time, 1 thread per trial; median of {repeats} interleaved repeat(s)"
    )


def _report(
    runs: dict[str, list[dict[str, Any]]],
    smoke: bool,
    repeats: int,
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
) -> None:
    """Print the side-by-side table and ratios of the interleaved runs."""
    med = {
        k: {m: statistics.median(r[m] for r in rs) for m in rs[0] if m in TIMES}
        for k, rs in runs.items()
    }
    ray_version = runs["ray"][0]["ray"]
    _print_setting(smoke, repeats, load_start, load_end)
    best = {k: min(r["best_validation_error"] for r in rs) for k, rs in runs.items()}
    print("| run | wall s | best validation_error |")
    print("| --- | --- | --- |")
    print(
        f"| ours: python -m flows.experiment, no servers | {med['ours']['wall_s']:.1f} | "
        f"{best['ours']:.4f} |"
    )
    print(
        f"| Ray Tune {ray_version}: whole process | {med['ray']['wall_s']:.1f} | "
        f"{best['ray']:.4f} |"
    )
    print(
        f"| ours on warm services (python -m infra.warm_home start) | "
        f"{med['warm']['wall_s']:.1f} | {best['warm']:.4f} |"
    )
    print(f"| Ray Tune: before ray.init -> end of fit() | {med['ray']['from_ray_init_s']:.1f} | |")
    print(
        f"| Ray Tune: after ray.init (the issue's 53 s) | {med['ray']['after_ray_init_s']:.1f} | |"
    )
    print(
        f"ours / Ray Tune: {med['ours']['wall_s'] / med['ray']['wall_s']:.2f}x its whole "
        f"process, {med['ours']['wall_s'] / med['ray']['after_ray_init_s']:.2f}x its time "
        "after ray.init (target <= 1.00)"
    )
    batches = {k: statistics.median(r["batches_trained"] for r in rs) for k, rs in runs.items()}
    per_batch = {k: med[k]["wall_s"] / batches[k] for k in runs}
    ray_after_init = med["ray"]["after_ray_init_s"] / batches["ray"]
    print(
        f"per trained batch (batches: ours {batches['ours']:.0f}, on warm services "
        f"{batches['warm']:.0f}, Ray {batches['ray']:.0f}): ours / Ray whole process "
        f"{per_batch['ours'] / per_batch['ray']:.2f}x; ours on warm services / Ray whole "
        f"process {per_batch['warm'] / per_batch['ray']:.2f}x, / Ray after ray.init "
        f"{per_batch['warm'] / ray_after_init:.2f}x (issue 24's target <= 0.8x)"
    )
    print(
        f"Ray Tune import {med['ray']['import_s']:.1f} s, ray.init {med['ray']['init_s']:.1f} s; "
        f"raw: {json.dumps(runs)}"
    )


if __name__ == "__main__":
    main()
