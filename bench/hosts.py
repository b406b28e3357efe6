"""Many hosts on one machine (issue 44), measured on a cluster of the bench's own: network
namespaces on a private bridge (infra/hosts.py: the stack on host 0's bridge address, one
Dask worker on each of 2 worker hosts, model code only as an S3 package), on its own ports,
subnet and names, in a temporary folder, all of it removed at the end (Ctrl-C and SIGTERM
included).

1. A host lost mid-trial: the flow tests' killable XOR experiment (120 batches, a checkpoint
   every 30, ``--sleep-s`` a batch, a training metric every batch: ``scheduling_unit=1``).
   Once its first checkpoint is recorded, every process of the host training it is
   SIGKILLed. Printed per repeat and as medians: seconds from the kill until the scheduler
   shows the trial's step processing on the other host, and until the trial's next
   training metric is in MLflow.
2. Batches replayed after the loss: the victim's last training step in MLflow at the kill
   minus the checkpoint the survivor restored from (named in the flow's step log, its batch
   from the checkpoint's record), against the checkpoint period. The metrics sink sends
   every ~2 s, so a SIGKILL loses up to that much unsent: the true figure is up to that
   many batches higher (also estimated from the pace of the victim's points).
3. A step across namespaces against loopback: the same warm steps, submitted through
   ``cluster.steps.submit_step`` to a held trial on the hosts cluster and on a loopback
   stack (its own 2 Dask workers on 127.0.0.1), alternating, ``--steps`` each:
   - ``validate`` at the trial's position: computed once per position, so every repeat is
     the step's machinery and its round trips alone (client -> scheduler -> worker ->
     scheduler -> client, the result pickled back), which is what a network changes;
   - ``train`` of one batch: the same plus a batch and its metric report.
   Printed: median and p90 per step, the time inside the worker, and the ratios.

Needs root and iproute2's ``ip`` (network namespaces): exits 2 saying so otherwise.

    .venv/bin/python bench/hosts.py [--repeats 3] [--steps 30] [--sleep-s 0.2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import itertools
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from det_latency import stack_config, until  # noqa: E402  (a sibling script, not a package)

from infra import hosts as hosts_lib  # noqa: E402
from infra import netns  # noqa: E402
from infra import stack as stack_lib  # noqa: E402
from tests.integration.helpers import FLOW_MODEL, environment  # noqa: E402
from tests.integration.hosts_helpers import (  # noqa: E402
    finished_flow,
    killed_on_error,
    start_flow,
    wait_for_checkpoints,
)

# Apart from `python -m infra.hosts up` (10.77.0, dth) and the tests (10.79.x, prefixes "t...").
SUBNET = "10.78.50"
PREFIX = "bh"
# Offsets of bench/det_latency.py's ports: apart from the other benches' and each other's.
HOSTS_PORTS = 500
LOOPBACK_PORTS = 520
KILLABLE = FLOW_MODEL / "killable.yaml"
TRAINING = "training/loss"
POLL_S = 0.2  # how often the recovery is looked at (the times' resolution)
RECOVERY_TIMEOUT_S = 300
STEP_EXPERIMENT = "bench-hosts-step"
WARMUP_BATCHES = 5  # the held trial's position before the timed steps


@dataclasses.dataclass
class Recovery:
    """Seconds from the kill until the scheduler had dropped the victim's worker, until a
    step of the trial ran on another host, and until a training metric past the victim's
    last one was in MLflow (and that metric's batch)."""

    gone_s: float | None = None
    elsewhere_s: float | None = None
    metric_s: float | None = None
    metric_step: int = -1


@dataclasses.dataclass(frozen=True)
class Loss:
    """One host lost mid-trial and what followed."""

    victim: int
    survivor: int
    recovery: Recovery
    last_logged: int  # the victim's last training step in MLflow at the kill
    estimated_at: int  # the victim's batch at the kill, from the pace of its points
    restored: int  # the batch of the checkpoint the survivor restored from
    missing: list[int]  # training steps MLflow never got, once the experiment ended

    @property
    def replayed(self) -> int:
        """Batches the victim is known to have trained past the restored checkpoint (it
        made that checkpoint, so it was at least there)."""
        return max(self.last_logged, self.restored) - self.restored


def busy_hosts(cluster: hosts_lib.Hosts, dask: Any) -> set[int]:
    """Hosts whose worker runs a step now, asked over one held connection (a new client per
    look, as tests/integration/hosts_helpers.busy_hosts makes, costs more than a poll)."""
    return {cluster.host_of(w) for w, keys in dask.processing().items() if keys}


def lose_a_host(
    cluster: hosts_lib.Hosts, dask: Any, mlflow: Any, home: Path, name: str, sleep_s: float
) -> Loss:
    """Run the experiment, SIGKILL the host training it after its first checkpoint, and time
    its recovery on the other host."""
    flow = start_flow(
        cluster, home, name, f"hyperparameters.sleep_s={sleep_s}", "scheduling_unit=1"
    )
    with killed_on_error(flow):
        trial = wait_for_checkpoints(cluster, flow, name)
        run_id = trial.info.run_id
        # The checkpoint is recorded as its upload ends: the next step may not run yet.
        (victim,) = until(lambda: busy_hosts(cluster, dask), 30, f"{name}'s next step", 0.05)
        lost_wall, lost = time.time(), time.monotonic()
        cluster.lose(victim)
        points = mlflow.get_metric_history(run_id, TRAINING)  # the victim sends no more
        last = max((p.step for p in points), default=0)
        seen = recovery(cluster, dask, mlflow, run_id, victim, last, lost, flow)
    _, err = finished_flow(flow)
    survivor, restored = restored_from(cluster, err, mlflow, run_id)
    at = estimated_position(points, lost_wall)
    return Loss(victim, survivor, seen, last, at, restored, missing_steps(mlflow, run_id))


def recovery(
    cluster: hosts_lib.Hosts,
    dask: Any,
    mlflow: Any,
    run_id: str,
    victim: int,
    last: int,
    lost: float,
    flow: subprocess.Popen[str],
) -> Recovery:
    """What the scheduler and MLflow show after the kill at ``lost``, looked at every
    POLL_S until a step runs on another host and a training metric past ``last`` is in."""
    seen = Recovery()
    while None in (seen.gone_s, seen.elsewhere_s, seen.metric_s):
        since = time.monotonic() - lost
        if flow.poll() is not None or since > RECOVERY_TIMEOUT_S:
            raise RuntimeError(f"no recovery in {since:.0f} s; the flow ended {flow.poll()}")
        busy: dict[int, bool] = {}
        for worker, keys in dask.processing().items():
            host = cluster.host_of(worker)
            busy[host] = busy.get(host, False) or bool(keys)
        if seen.gone_s is None and victim not in busy:
            seen.gone_s = since
        if seen.elsewhere_s is None and any(b for host, b in busy.items() if host != victim):
            seen.elsewhere_s = since
        if seen.metric_s is None:
            since = time.monotonic() - lost
            newer = [p.step for p in mlflow.get_metric_history(run_id, TRAINING) if p.step > last]
            if newer:
                seen.metric_s, seen.metric_step = since, min(newer)
        time.sleep(POLL_S)
    return seen


def missing_steps(mlflow: Any, run_id: str) -> list[int]:
    """The batches (1..searcher.max_length) with no training metric in MLflow."""
    total = yaml.safe_load(KILLABLE.read_text())["searcher"]["max_length"]["batches"]
    have = {p.step for p in mlflow.get_metric_history(run_id, TRAINING)}
    return sorted(set(range(1, total + 1)) - have)


def spans(steps: list[int]) -> str:
    """``[25, 26, 27, 40]`` as "25-27, 40" ("none" when empty)."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def estimated_position(points: list[Any], lost_wall: float) -> int:
    """The victim's batch at the kill: its last logged step plus the batches its pace (the
    median seconds a batch between its last points, stamped as each batch ended) fits
    between that point and the kill."""
    recent = sorted(points, key=lambda p: p.step)[-11:]
    if len(recent) < 2:
        return recent[-1].step if recent else 0
    pace = statistics.median(
        (b.timestamp - a.timestamp) / (b.step - a.step) / 1000
        for a, b in itertools.pairwise(recent)
        if b.step > a.step
    )
    unsent_s = max(0.0, lost_wall - recent[-1].timestamp / 1000)
    return int(recent[-1].step + (unsent_s / pace if pace > 0 else 0))


def restored_from(cluster: hosts_lib.Hosts, err: str, mlflow: Any, run_id: str) -> tuple[int, int]:
    """The host of the first step restored from a checkpoint (the flow's step log:
    "... on tcp://IP:PORT (restored from runs:/.../checkpoints/UUID, ...") and that
    checkpoint's batch (its record's steps_completed)."""
    from registry.checkpoints.store import checkpoint_records

    found = re.search(r" on tcp://([\d.]+):\d+ \(restored from (runs:/[^,\s]+)", err)
    if found is None:
        raise RuntimeError(f"no step restored from a checkpoint in the flow's log:\n{err[-3000:]}")
    ip, uri = found.groups()
    checkpoint = uri.rstrip("/").rsplit("/", 1)[-1]
    records = checkpoint_records(mlflow, run_id)
    record = next((r for r in records if r["uuid"] == checkpoint), None)
    if record is None:
        raise RuntimeError(f"{uri} is none of the trial's checkpoints {records}")
    return cluster.host_of(f"tcp://{ip}:0"), int(record["steps_completed"])


def losses(cluster: hosts_lib.Hosts, tmp: Path, repeats: int, sleep_s: float) -> list[Loss]:
    """Parts 1 and 2: ``repeats`` losses, each host healed (its worker restarted) after."""
    from distributed import Client

    from registry.runs.tracking import client_for

    mlflow = client_for(cluster.env["MLFLOW_TRACKING_URI"])
    done: list[Loss] = []
    with Client(cluster.env["DET_TASKS_DASK_SCHEDULER"], timeout=30) as dask:
        for i in range(repeats):
            name = f"bench-hosts-lost-{i + 1}"
            loss = lose_a_host(cluster, dask, mlflow, tmp / name, name, sleep_s)
            print_loss(i + 1, loss)
            done.append(loss)
            cluster.heal()
    return done


def print_loss(repeat: int, loss: Loss) -> None:
    seen = loss.recovery
    print(
        f"   repeat {repeat}: host {loss.victim} lost. After {seen.gone_s:.1f} s the scheduler "
        f"had dropped its worker; after {seen.elsewhere_s:.1f} s the trial's step ran on host "
        f"{loss.survivor}; after {seen.metric_s:.1f} s its next training metric (batch "
        f"{seen.metric_step}) was in MLflow.\n"
        f"      restored from the checkpoint at batch {loss.restored}; the victim's last "
        f"training metric in MLflow at the kill: batch {loss.last_logged}; its batch at the "
        f"kill, from its pace: about {loss.estimated_at}; replayed: at least "
        f"{loss.replayed}, about {max(0, loss.estimated_at - loss.restored)}; training "
        f"metrics missing from MLflow at the end: {spans(loss.missing)}",
        flush=True,
    )


def print_losses(done: list[Loss], sleep_s: float) -> None:
    from registry.metrics.sink import MlflowMetricsSink

    flush_s = inspect.signature(MlflowMetricsSink).parameters["flush_interval_s"].default
    period = yaml.safe_load(KILLABLE.read_text())["min_checkpoint_period"]["batches"]
    slack = round(flush_s / sleep_s)
    median = {
        what: statistics.median(getattr(x.recovery, what) for x in done)
        for what in ("gone_s", "elsewhere_s", "metric_s")
    }
    print(
        f"1. host lost -> its worker dropped by the scheduler: median {median['gone_s']:.1f} s; "
        f"-> the trial's step on the other host: median {median['elsewhere_s']:.1f} s; -> its "
        f"next training metric in MLflow: median {median['metric_s']:.1f} s ({len(done)} "
        f"losses, looked at every {POLL_S} s)"
    )
    replayed = [x.replayed for x in done]
    estimated = [max(0, x.estimated_at - x.restored) for x in done]
    within = all(n <= period for n in replayed) and all(n <= period + slack for n in estimated)
    print(
        f"2. batches replayed after the loss: at least {replayed} (the victim's training "
        f"metrics in MLflow at the kill), about {estimated} (from their pace; it counts the "
        f"checkpoint step's time as training, so it may run high); bound: the checkpoint "
        f"period, {period} batches (+ up to {slack} the sink had not sent: its {flush_s:g} s "
        f"flush interval at {sleep_s:g} s a batch): {'within' if within else 'EXCEEDED'}; "
        f"losses that left training metrics missing in MLflow: "
        f"{sum(1 for x in done if x.missing)} of {len(done)}"
    )


@dataclasses.dataclass
class HeldTrial:
    """A trial held on one worker of one cluster, and the times of the steps sent to it."""

    label: str
    dask: Any
    first: Any  # the StepRequest that built it
    worker: str
    position: int
    times: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    cold: int = 0  # timed steps that were not warm on the worker (restored or moved)


def hold_a_trial(label: str, env: dict[str, str], dask: Any) -> HeldTrial:
    """The XOR trial (no sleep) built on one worker of the cluster ``env`` names: shipped
    as a package, trained to WARMUP_BATCHES and validated there once."""
    from cluster.held_trials import PLUGIN_NAME, HeldTrialPlugin, StepRequest
    from cluster.steps import submit_step
    from det_tasks.checkpoints.model_package import pack_model_dir
    from det_tasks.config.entered import enter_file
    from det_tasks.runner.held import TrialSpec
    from registry.experiments.packages import upload_package
    from registry.runs.tracking import ExperimentRuns, client_for

    text = KILLABLE.read_text()
    run_key = uuid.uuid4().hex
    with environment({**os.environ, **env}):  # this process's, with the cluster's
        package, _ = upload_package(pack_model_dir(FLOW_MODEL))
        raw = {**yaml.safe_load(text), "name": STEP_EXPERIMENT}
        runs = ExperimentRuns(client_for(env["MLFLOW_TRACKING_URI"]), STEP_EXPERIMENT, run_key, raw)
    overrides = (
        f"name={STEP_EXPERIMENT}",
        "hyperparameters.sleep_s=0",
        "scheduling_unit=1",
        "searcher.max_length={batches: 100000}",
    )
    spec = TrialSpec(
        config_path=KILLABLE.name,
        model_dir="model",  # replaced on the worker by the package's folder
        overrides=overrides,
        trial_id=1,
        hparams={},
        experiment_run_key=run_key,
        config=enter_file(KILLABLE, list(overrides)),  # entered once, here, as a flow does
    )
    first = StepRequest(
        trial=spec, kind="train", start=0, stop=WARMUP_BATCHES,
        parent_run_id=runs.parent_run_id, experiment_id=runs.experiment_id,
        package=package,
    )  # fmt: skip
    dask.register_plugin(HeldTrialPlugin(), name=PLUGIN_NAME)
    with dask.as_current():
        built = submit_step(first)
        held = HeldTrial(label, dask, first, built.worker, built.position)
        submit_step(dataclasses.replace(first, kind="validate", start=held.position), [held.worker])
    return held


def timed_step(held: HeldTrial, kind: str) -> None:
    """One warm ``kind`` step (validate at the position, or train one batch) on the held
    trial's worker; its wall time at the client and its time inside the worker kept."""
    from cluster.steps import submit_step

    stop = held.position + (1 if kind == "train" else 0)
    request = dataclasses.replace(held.first, kind=kind, start=held.position, stop=stop)
    with held.dask.as_current():
        began = time.perf_counter()
        result = submit_step(request, [held.worker])
        took = time.perf_counter() - began
    held.position = result.position
    held.cold += int(not result.warm or result.worker != held.worker)
    held.times.setdefault(kind, []).append((took, result.seconds))


def step_costs(stacks: list[tuple[str, dict[str, str]]], steps: int) -> None:
    """Part 3: ``steps`` of each kind on each cluster's held trial, alternating clusters
    (and which goes first), so a busy moment of the machine falls on both."""
    from distributed import Client

    from cluster.steps import release_everywhere

    clients = [Client(env["DET_TASKS_DASK_SCHEDULER"], timeout=30) for _, env in stacks]
    try:
        held = [hold_a_trial(label, env, c) for (label, env), c in zip(stacks, clients)]
        for kind in ("validate", "train"):
            for i in range(steps):
                for trial in held if i % 2 == 0 else held[::-1]:
                    timed_step(trial, kind)
        print_step_costs(held, steps)
    finally:
        for client in clients:
            with contextlib.suppress(Exception):  # the stacks' teardown ends them anyway
                release_everywhere(client)
            client.close()


def _ms(values: list[float]) -> tuple[float, float]:
    """Median and p90, in ms."""
    p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
    return statistics.median(values) * 1000, p90 * 1000


def print_step_costs(held: list[HeldTrial], steps: int) -> None:
    print(
        f"3. a warm step through cluster.steps.submit_step, {steps} of each per cluster, "
        "alternating (ms; 'in worker': the step's own time there, the rest is the round trip)"
    )
    print(f"   {'step':<22}{'cluster':<34}{'median':>9}{'p90':>9}{'in worker':>11}")
    for kind, what in (("validate", "validate (cached)"), ("train", "train 1 batch")):
        stats = []
        for trial in held:
            wall, inside = zip(*trial.times[kind])
            stats.append(_ms(list(wall)))
            median, p90 = stats[-1]
            worker = statistics.median(inside) * 1000
            print(f"   {what:<22}{trial.label:<34}{median:>9.1f}{p90:>9.1f}{worker:>11.1f}")
        (hosts_median, hosts_p90), (loop_median, loop_p90) = stats
        print(
            f"   {'':<22}{'ratio hosts / loopback':<34}{hosts_median / loop_median:>9.2f}"
            f"{hosts_p90 / loop_p90:>9.2f}"
        )
    cold = {t.label: t.cold for t in held if t.cold}
    if cold:
        print(f"   steps that were not warm on their worker (counted in): {cold}")


@contextlib.contextmanager
def loopback_stack(root: Path) -> Iterator[dict[str, str]]:
    """A stack on 127.0.0.1 with its own 2 Dask workers (no Prefect: steps only)."""
    config = dataclasses.replace(stack_config(root, LOOPBACK_PORTS), dask_workers=2)
    try:
        print("starting a loopback stack (about a minute)...", file=sys.stderr, flush=True)
        yield stack_lib.up(config, prefect=False)
    finally:
        stack_lib.down(config)


def hosts_config(root: Path) -> hosts_lib.HostsConfig:
    network = netns.Network(hosts=2, subnet=SUBNET, prefix=PREFIX)
    return hosts_lib.HostsConfig.on(root, network, stack_config(root / "stack", HOSTS_PORTS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="hosts lost (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="steps of each kind (default 30)")
    parser.add_argument("--sleep-s", type=float, default=0.2, help="per batch (default 0.2)")
    args = parser.parse_args()
    missing = netns.missing_requirements()
    if missing:
        print(f"bench/hosts.py needs network namespaces: {missing}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average (1, 5, "
        f"15 min) at the start: {', '.join(f'{x:.1f}' for x in load)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as folder:
        tmp = Path(folder)
        print("starting the hosts cluster (a minute or two)...", file=sys.stderr, flush=True)
        with hosts_lib.running(hosts_config(tmp / "hosts")) as cluster:
            print("1-2. a host lost mid-trial:", flush=True)
            done = losses(cluster, tmp, args.repeats, args.sleep_s)
            print_losses(done, args.sleep_s)
            with loopback_stack(tmp / "loopback") as loopback:
                across = f"hosts (namespaces, {SUBNET}.x)"
                step_costs([(across, cluster.env), ("loopback (127.0.0.1)", loopback)], args.steps)
    print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
