"""Chaos on real hosts: one experiment of 3 trials on the session's hosts cluster (services
on host 0, a worker on each of hosts 1 and 2) while, at random points one after another,
the parts under it die:

- ``scheduler``: the Dask scheduler SIGKILLed, started again a few seconds later;
- ``launcher``: the flow's process SIGKILLed, the experiment continued with ``--activate``;
- ``host``: a worker host lost (every process SIGKILLed), healed a few seconds later;
- ``mlflow``: the MLflow server SIGKILLed, started again a few seconds later;
- ``stack``: the whole stack stopped and started (continued if the flow did not outlive it).

At the end: every trial's final weights are bit-equal to the same trial run undisturbed,
MLflow holds every training step and checkpoint of every trial exactly once, no run is
RUNNING, and no trial was ever recorded COMPLETED short of its 120 batches.

The seed picks the order and the moments; it is printed, and ``DET_TASKS_CHAOS_SEED``
replays one. CI runs 3 faults (``DET_TASKS_CHAOS_FAULTS``, default 3) within its time; the
full set of 5 runs with ``DET_TASKS_CHAOS_FAULTS=5`` (docs/reliability.md).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from infra import dask_cluster, services, stack
from infra import hosts as hosts_lib
from tests.integration.helpers import FLOW_MODEL, home_env, run_xor_trial
from tests.integration.hosts_helpers import busy_hosts, client_env, needs_hosts

pytestmark = [needs_hosts, pytest.mark.slow]

NAME = "hosts-chaos"
WIDTHS = (4, 6, 8)  # the grid's 3 trials: hyperparameters.hidden
OVERRIDES = [
    f"name={NAME}",
    "searcher.name=grid",
    "searcher.max_concurrent_trials=2",
    f"hyperparameters.hidden={{type: categorical, vals: {list(WIDTHS)}}}",
    "hyperparameters.sleep_s=0.2",
]
TRAINING_STEPS = [30, 60, 90, 100, 120]
CHECKPOINTS = [30, 60, 90, 120]
FAULTS = ("scheduler", "launcher", "host", "mlflow", "stack")

# The experiment flow from an S3 package, as `det experiment create` runs it; a second
# argument continues the experiment run with that key.
FLOW = """
import sys
from pathlib import Path
from det_tasks.checkpoints.model_package import pack_model_dir
from registry.experiments.packages import upload_package
from flows.experiment import experiment

model, config, key = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] or None
uri, _ = upload_package(pack_model_dir(model))
state = experiment(config=config.name, overrides=sys.argv[4:], package=uri,
                   config_yaml=config.read_text(), experiment_key=key, return_state=True)
sys.exit(0 if state.is_completed() else 1)
"""


class _Chaos:
    """The experiment's flow process (started again when a fault ends it) and what MLflow
    shows while it runs."""

    def __init__(self, cluster: hosts_lib.Hosts, home: Path, rng: random.Random) -> None:
        from registry.runs.tracking import client_for

        self.cluster, self.home, self.rng = cluster, home, rng
        self.mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
        self.flow = self._start(key="")
        self.early: list[tuple[str, int]] = []  # (trial, batches) seen COMPLETED short
        self.watching = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _start(self, key: str) -> subprocess.Popen[str]:
        log = open(self.home / f"flow-{time.time_ns()}.log", "w")  # noqa: SIM115
        return subprocess.Popen(
            [sys.executable, "-c", FLOW, str(FLOW_MODEL), str(FLOW_MODEL / "killable.yaml"),
             key, *OVERRIDES],
            env=client_env(self.cluster, self.home), stdout=log, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip

    def trial_runs(self) -> list[Any]:
        experiment = self.mlflow.get_experiment_by_name(NAME)
        if experiment is None:
            return []
        runs = self.mlflow.search_runs([experiment.experiment_id])
        return [r for r in runs if "mlflow.parentRunId" in r.data.tags]

    def key(self) -> str:
        experiment = self.mlflow.get_experiment_by_name(NAME)
        (parent,) = [
            r
            for r in self.mlflow.search_runs([experiment.experiment_id])
            if "mlflow.parentRunId" not in r.data.tags
        ]
        return str(parent.data.tags["det.experiment_run"])

    def checkpoints(self) -> int:
        from registry.checkpoints.store import checkpoint_records

        return sum(len(checkpoint_records(self.mlflow, r.info.run_id)) for r in self.trial_runs())

    def _watch(self) -> None:
        while not self.watching.wait(0.3):
            try:
                for run in self.trial_runs():
                    batches = int(run.data.metrics.get("progress/batches", -1))
                    if run.data.tags.get("det.state") == "COMPLETED" and batches < 120:
                        self.early.append((run.data.tags.get("det.trial_id", "?"), batches))
            except Exception:  # MLflow away (a fault): the next look
                continue

    def wait_new_checkpoints(self, count: int) -> None:
        """Until ``count`` more checkpoints are recorded (continuing a dead flow)."""
        target = self.checkpoints() + count
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.flow.poll() is not None:
                if self.flow.returncode == 0:
                    return  # it finished: the remaining faults hit nothing
                self.continue_it()
            try:
                if self.checkpoints() >= target:
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise AssertionError(f"no {count} new checkpoints within 400 s")

    def continue_it(self) -> None:
        print(f"chaos: continuing experiment {self.key()[:8]}")
        self.flow = self._start(key=self.key())

    def finish(self) -> None:
        """Until the experiment ends 0 (continued whenever a fault ended its flow)."""
        for _ in range(4):
            if self.flow.wait(timeout=600) == 0:
                break
            self.continue_it()
        self.watching.set()
        self.watcher.join(timeout=10)
        assert self.flow.returncode == 0, "the experiment did not finish"


def _apply(chaos: _Chaos, fault: str) -> None:
    cluster, rng = chaos.cluster, chaos.rng
    config = cluster.config
    pause = rng.uniform(2, 8)
    print(f"chaos: {fault} (back after {pause:.1f} s)")
    if fault == "scheduler":
        scheduler = dask_cluster.scheduler_service(
            config.stack.root, config.stack.dask_port, config.stack.host
        )
        os.killpg(int(scheduler.pidfile.read_text().strip()), signal.SIGKILL)
        time.sleep(pause)
        hosts_lib.heal(config)
    elif fault == "launcher":
        chaos.flow.kill()
        chaos.flow.wait()
        chaos.continue_it()
    elif fault == "host":
        busy = sorted(busy_hosts(cluster)) or cluster.workers
        cluster.lose(rng.choice(busy))
        time.sleep(pause)
        hosts_lib.heal(config)
    elif fault == "mlflow":
        server = stack.mlflow_service(config.stack)
        os.killpg(int(server.pidfile.read_text().strip()), signal.SIGKILL)
        time.sleep(pause)
        services.start(server)
    else:
        stack.down(config.stack)
        time.sleep(pause)
        hosts_lib.heal(config)


def _references(home: Path) -> dict[int, Path]:
    """Each grid trial's 120 batches run undisturbed by `det-tasks run`: its last checkpoint."""
    checkpoints = {}
    for width in WIDTHS:
        out = home / f"ref-{width}"
        done = run_xor_trial(
            f"chaos-ref-{width}", 120, home_env(out), FLOW_MODEL,
            "--param", f"hyperparameters.hidden={width}", "--checkpoint-dir", str(out / "ckpt"),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        checkpoints[width] = max((out / "ckpt").iterdir(), key=lambda p: p.stat().st_mtime)
    return checkpoints


def _assert_recorded_once_and_equal(chaos: _Chaos, references: dict[int, Path]) -> None:
    import torch

    from det_tasks import pytorch
    from registry.checkpoints.store import checkpoint_records
    from tests.integration.helpers import environment

    runs = chaos.trial_runs()
    assert len(runs) == len(WIDTHS), [r.info.run_id for r in runs]
    for run in runs:
        run_id = run.info.run_id
        history = chaos.mlflow.get_metric_history(run_id, "training/loss")
        assert sorted(m.step for m in history) == TRAINING_STEPS, (run_id, history)
        records = checkpoint_records(chaos.mlflow, run_id)
        assert [r["steps_completed"] for r in records] == CHECKPOINTS, (run_id, records)
        width = int(run.data.params["hp.hidden"])
        with environment(**chaos.cluster.env):
            got = pytorch.load_trial_from_checkpoint_path(records[-1]["uri"])
        # Written under another home (its own signing key): loaded with the class, as code.
        ref = pytorch.load_trial_from_checkpoint_path(str(references[width]), trial_class=type(got))
        pairs = zip(ref.model.state_dict().values(), got.model.state_dict().values(), strict=True)
        for a, b in pairs:
            assert torch.equal(a, b), f"trial hidden={width} differs from its undisturbed run"
    experiment = chaos.mlflow.get_experiment_by_name(NAME)
    statuses = {r.info.status for r in chaos.mlflow.search_runs([experiment.experiment_id])}
    assert statuses == {"FINISHED"}, statuses


def test_an_experiment_outlives_whatever_dies_under_it(
    cluster: hosts_lib.Hosts, tmp_path: Path
) -> None:
    seed = int(os.environ.get("DET_TASKS_CHAOS_SEED", str(random.randrange(1 << 30))))
    count = int(os.environ.get("DET_TASKS_CHAOS_FAULTS", "3"))
    rng = random.Random(seed)
    faults = rng.sample(FAULTS, k=min(count, len(FAULTS)))
    print(f"chaos: seed {seed} (DET_TASKS_CHAOS_SEED), faults in order: {faults}")
    references = _references(tmp_path / "references")
    chaos = _Chaos(cluster, tmp_path, rng)
    try:
        for fault in faults:
            chaos.wait_new_checkpoints(rng.choice([1, 2]))
            _apply(chaos, fault)
        chaos.finish()
    finally:
        if chaos.flow.poll() is None:
            chaos.flow.kill()
        hosts_lib.heal(cluster.config)  # the next tests get the whole cluster
        for log in sorted(tmp_path.glob("flow-*.log")):
            print(f"--- {log.name}\n{log.read_text()[-2500:]}")
    assert not chaos.early, f"seed {seed}: trials recorded COMPLETED short of 120: {chaos.early}"
    _assert_recorded_once_and_equal(chaos, references)
