"""From a fault to training again (issue 49), on a loopback stack of the bench's own
(``infra.stack`` on its own ports, in a temporary folder, stopped at the end, Ctrl-C and
SIGTERM included): the flow tests' killable XOR experiment (120 batches, a checkpoint every
30, ``--sleep-s`` a batch, a training metric every batch: ``scheduling_unit=1``), run as a
user runs it (``python -m flows.experiment killable.yaml ...`` with the stack's variables),
and hit, once its first checkpoint is recorded and its training metric ``--past`` batches
later is in MLflow, by one of:

1. ``scheduler``: the Dask scheduler's process group SIGKILLed (its pidfile), started again
   ``--down-s`` later with ``infra.stack.up`` (what ``python -m infra.stack up`` runs); the
   workers come back by themselves (infra.supervise) and the same flow goes on.
2. ``launcher``: the flow's process SIGKILLed (a crash, the OOM killer), then the same
   command with ``--activate KEY`` (KEY: the parent run's ``det.experiment_run``). The
   killed flow's step trains on, on its worker, with no flow to report to: the command
   starts once no training metric was stamped for QUIET_S, so the next metric is surely
   the continued experiment's (how far the step trained on is printed).
3. ``stack``: ``infra.stack.down`` under the running experiment, then ``infra.stack.up``;
   if the flow ended, the same command with ``--activate KEY`` continues it; if it
   survived, its own next metric is measured (and said so).

Per fault and repeat: seconds from the fault, and from the restart (the scheduler's or the
stack's start, or the continue command's), to the trial's next training metric in MLflow:
a batch past the newest MLflow held as the restart began, stamped after it (the sink never
sends a batch twice, so the batches replayed show no point: the time includes their
replay); when every Dask worker was registered again; when the experiment ended. Batches
replayed: the trial's last training metric stamped before the restart minus the
checkpoint the next step restored from, named in the flow's step log (a step that found
the trial still held replays none). Correctness: every run of each experiment FINISHED, its
final validation equal to an undisturbed run's on the same stack, every training step
1..120 in MLflow exactly once; anything else is printed as a MISS.

    .venv/bin/python bench/fault_recovery.py [--repeats 2] [--down-s 5] [--sleep-s 0.2]
        [--past 15] [--faults scheduler,launcher,stack] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from det_latency import stack_config, until  # noqa: E402  (a sibling script, not a package)
from hosts import KILLABLE, TRAINING, missing_steps, spans  # noqa: E402

from infra import dask_cluster  # noqa: E402
from infra import stack as stack_lib  # noqa: E402
from infra.services import port_open  # noqa: E402
from infra.stack_config import StackConfig  # noqa: E402
from tests.integration.helpers import env_without_platform  # noqa: E402
from tests.integration.hosts_helpers import trial_run  # noqa: E402

# Offset of bench/det_latency.py's ports: every port (24-32 thousand, S3's gRPC 9-10
# thousand) below the ephemeral range (32768-60999), so while the stack is down no other
# program's random listening port (a Dask worker's, a dashboard's) can take one of them (it
# did, at 560 + 8900: `up` refused "port 47641 (for seaweedfs) is already in use"); ports
# ending in 31-39, 50, 51, 83, 84: apart from the tests' (isolated_stack_config at offsets of
# 100) and bench/hosts.py's.
PORTS = -7050
QUIET_S = 5.0  # no training metric stamped for this long: the trial stopped training
POLL_S = 0.2  # how often MLflow is looked at (the times' resolution)
RECOVERY_TIMEOUT_S = 600  # the flow's Dask client waits up to 10 min for its scheduler
FAULTS = ("scheduler", "launcher", "stack")
VALIDATION = "validation/validation_loss"


@dataclasses.dataclass
class Outcome:
    """One fault and what followed (wall-clock seconds since the epoch, as MLflow stamps)."""

    fault: str
    fault_at: float
    restart_at: float  # the scheduler's or the stack's start, or the continue command's
    last_before: int = 0  # the trial's last training metric stamped before the restart
    continue_at: float | None = None  # when the ``--activate`` command started
    metric_at: float = 0.0  # when its next training metric was seen in MLflow
    metric_step: int = -1
    resumed: str = ""  # "warm", or the batch of the checkpoint it restored from
    continued: str = ""  # how it went on: the same flow, or --activate
    workers_at: float | None = None  # when the scheduler listed every worker again
    done_at: float = 0.0  # when the (continued) flow ended 0
    notes: list[str] = dataclasses.field(default_factory=list)  # what else was seen
    misses: list[str] = dataclasses.field(default_factory=list)

    @property
    def from_fault_s(self) -> float:
        return self.metric_at - self.fault_at

    @property
    def from_restart_s(self) -> float:
        return self.metric_at - self.restart_at

    @property
    def replayed(self) -> int | None:
        if not self.resumed.isdigit():
            return 0 if self.resumed == "warm" else None
        return max(0, self.last_before - int(self.resumed))


class Bench:
    """The stack, its MLflow, the user's command line and the undisturbed run's result."""

    def __init__(self, config: StackConfig, env: dict[str, str], tmp: Path, args: Any) -> None:
        from registry.runs.tracking import client_for

        self.config, self.tmp, self.args = config, tmp, args
        self.env = env_without_platform(**env, PYTHONPATH=str(ROOT))
        self.mlflow = client_for(env["MLFLOW_TRACKING_URI"])
        self.reference: float | None = None  # the undisturbed run's final validation loss
        self.scheduler = env["DET_TASKS_DASK_SCHEDULER"]
        self.workers = len(until(lambda: dask_cluster.registered_workers(self.scheduler), 120,
                                 "the stack's Dask workers"))  # fmt: skip

    def launch(self, name: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        """``python -m flows.experiment killable.yaml`` as a user types it, in a home of its
        own under the bench's folder; its output to a log file (read after)."""
        home = self.tmp / name
        (home / "det").mkdir(parents=True, exist_ok=True)
        log = home / f"flow-{len(list(home.glob('flow-*.log')))}.log"
        argv = [sys.executable, "-m", "flows.experiment", str(KILLABLE), f"name={name}",
                f"hyperparameters.sleep_s={self.args.sleep_s}", "scheduling_unit=1",
                *extra]  # fmt: skip
        env = {**self.env, "DET_TASKS_HOME": str(home / "det"), "PREFECT_HOME": str(home / "p")}
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
        return proc, log

    def trial(self, name: str) -> Any:
        return until(lambda: trial_run(self.mlflow, name), 300, f"{name}'s trial run", POLL_S)

    def points(self, run_id: str) -> list[Any]:
        return self.mlflow.get_metric_history(run_id, TRAINING)

    def newest_step(self, run_id: str) -> int:
        return max((p.step for p in self.points(run_id)), default=0)


def midway(bench: Bench, name: str, flow: subprocess.Popen[bytes]) -> str:
    """The trial's run id once its first checkpoint is recorded and its training metric
    ``--past`` batches after it is in MLflow (the flow still running)."""
    from registry.checkpoints.store import checkpoint_records

    run_id = bench.trial(name).info.run_id

    def ready() -> bool:
        if flow.poll() is not None:
            raise RuntimeError(f"{name}'s flow ended {flow.returncode} before the fault")
        records = checkpoint_records(bench.mlflow, run_id)
        first = records[0]["steps_completed"] if records else None
        return first is not None and bench.newest_step(run_id) >= first + bench.args.past

    until(ready, 300, f"{name}'s first checkpoint and {bench.args.past} batches", POLL_S)
    return run_id


def next_metric(
    bench: Bench, run_id: str, outcome: Outcome, flow: subprocess.Popen[bytes], newest: int
) -> int | None:
    """Wait for a training metric past ``newest`` (what MLflow held as the restart began:
    the sink never sends a batch twice, so replayed ones show no point) and stamped after
    the restart; note when every worker is back. None once it came, else the flow's exit
    code (it ended first: 0 when it had no batch left to train)."""
    while True:
        if outcome.workers_at is None and _all_workers(bench):
            outcome.workers_at = time.time()
        newer = [
            p.step
            for p in bench.points(run_id)
            if p.step > newest and p.timestamp / 1000 > outcome.restart_at
        ]
        if newer:
            outcome.metric_at, outcome.metric_step = time.time(), min(newer)
            return None
        if flow.poll() is not None:
            if flow.returncode == 0:
                outcome.notes.append(f"the flow ended with no batch left to train past {newest}")
            return flow.returncode
        since = time.time() - outcome.fault_at
        if since > RECOVERY_TIMEOUT_S:
            raise RuntimeError(f"no training metric {since:.0f} s after the fault")
        time.sleep(POLL_S)


def _all_workers(bench: Bench) -> bool:
    return len(dask_cluster.registered_workers(bench.scheduler)) >= bench.workers


def finished(
    flow: subprocess.Popen[bytes], log: Path, what: str, outcome: Outcome | None = None
) -> str:
    """The flow's log once it ended 0 (else the bench stops, with the log's tail)."""
    try:
        flow.wait(timeout=RECOVERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        flow.kill()
        flow.wait()
    if outcome is not None:
        outcome.done_at = time.time()
    text = log.read_text(errors="replace")
    if flow.returncode != 0:
        raise RuntimeError(f"{what} ended {flow.returncode}:\n{text[-4000:]}")
    return text


def resumed_at(bench: Bench, log_after_fault: str, run_id: str) -> str:
    """How the trial's first step after the fault found it (the flow's step log): "warm"
    (still held), or the batch of the checkpoint it restored from ("0" from none)."""
    from registry.checkpoints.store import checkpoint_records

    found = re.search(r"\((warm|restored from (batch 0|\S+?)), [\d.]+ s", log_after_fault)
    if found is None:
        return "?"
    if found.group(2) is None:
        return "warm"
    uuid = found.group(2).rstrip("/").rsplit("/", 1)[-1]
    batches = {r["uuid"]: r["steps_completed"] for r in checkpoint_records(bench.mlflow, run_id)}
    return str(batches.get(uuid, 0 if found.group(2) == "batch 0" else "?"))


def last_stamped_before(bench: Bench, run_id: str, fault_at: float) -> int:
    """The trial's last training batch stamped before the fault (points the sink sent
    after it included: they were stamped as each batch ended)."""
    before = [p.step for p in bench.points(run_id) if p.timestamp / 1000 <= fault_at]
    return max(before, default=0)


def experiment_key(bench: Bench, name: str) -> str:
    """The ``--activate`` key: the MLflow tag ``det.experiment_run`` of the parent run."""
    from registry.runs.tracking import EXPERIMENT_RUN_TAG, PARENT_TAG

    experiment = bench.mlflow.get_experiment_by_name(name)
    runs = bench.mlflow.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if PARENT_TAG not in r.data.tags]
    return parent.data.tags[EXPERIMENT_RUN_TAG]


def check(bench: Bench, name: str, run_id: str) -> list[str]:
    """What is wrong with the ended experiment: runs not FINISHED, training steps missing
    or recorded twice, a final validation other than the undisturbed run's."""
    experiment = bench.mlflow.get_experiment_by_name(name)
    runs = bench.mlflow.search_runs([experiment.experiment_id])
    misses = [f"run {r.info.run_id} {r.info.status}" for r in runs if r.info.status != "FINISHED"]
    missing = missing_steps(bench.mlflow, run_id)
    if missing:
        misses.append(f"training steps missing: {spans(missing)}")
    counts = collections.Counter(p.step for p in bench.points(run_id))
    twice = sorted(step for step, n in counts.items() if n > 1)
    if twice:
        misses.append(f"training steps recorded more than once: {spans(twice)}")
    final = [(m.step, m.value) for m in bench.mlflow.get_metric_history(run_id, VALIDATION)]
    if bench.reference is not None and final[-1:] != [(120, bench.reference)]:
        misses.append(f"final validation {final[-1:]} != the undisturbed run's {bench.reference}")
    return misses


def undisturbed(bench: Bench) -> tuple[float, float]:
    """The experiment run through once, no fault: its final validation loss, and its
    command's seconds."""
    name = "fault-bench-undisturbed"
    began = time.time()
    flow, log = bench.launch(name)
    finished(flow, log, "the undisturbed run")
    took = time.time() - began
    run_id = bench.trial(name).info.run_id
    (final,) = [m for m in bench.mlflow.get_metric_history(run_id, VALIDATION) if m.step == 120]
    bench.reference = final.value
    return final.value, took


def scheduler_restart(bench: Bench, name: str) -> Outcome:
    """SIGKILL the Dask scheduler's process group, ``--down-s`` later ``infra.stack.up``."""
    flow, log = bench.launch(name)
    try:
        run_id = midway(bench, name, flow)
        scheduler = dask_cluster.scheduler_service(
            bench.config.root, bench.config.dask_port, bench.config.host
        )
        offset = log.stat().st_size
        fault_at = time.time()
        os.killpg(int(scheduler.pidfile.read_text().strip()), signal.SIGKILL)
        time.sleep(bench.args.down_s)
        outcome = Outcome("scheduler", fault_at, time.time(), continued="the same flow")
        newest = bench.newest_step(run_id)
        stack_lib.up(bench.config)
        next_metric(bench, run_id, outcome, flow, newest)
        text = finished(flow, log, "the flow after the scheduler's restart", outcome)
    finally:
        _killed(flow)
    return _settled(bench, name, run_id, outcome, text[offset:])


def launcher_killed(bench: Bench, name: str) -> Outcome:
    """SIGKILL the flow's process, then the same command with ``--activate KEY``."""
    flow, _ = bench.launch(name)
    try:
        run_id = midway(bench, name, flow)
        fault_at = time.time()
        flow.kill()
        flow.wait()
    finally:
        _killed(flow)
    last, after_s = trained_on(bench, run_id, fault_at)
    outcome = Outcome("launcher", fault_at, time.time())
    outcome.notes.append(
        f"the killed flow's step trained on, on its worker, to batch {last} ({after_s:.1f} s "
        f"after the kill); the continue command started once no metric was stamped for "
        f"{QUIET_S:g} s"
    )
    return continued(bench, name, run_id, outcome)


def trained_on(bench: Bench, run_id: str, fault_at: float) -> tuple[int, float]:
    """The trial's last batch and its stamp (s after the fault) once it stopped training
    (a killed flow's step may train on, on its worker, with no flow to report to): so the
    next metric after the continue command is surely the continued experiment's."""

    def stopped() -> tuple[int, float] | None:
        last = max(bench.points(run_id), key=lambda p: p.timestamp)
        stamped = last.timestamp / 1000
        return (last.step, stamped - fault_at) if time.time() - stamped > QUIET_S else None

    return until(stopped, RECOVERY_TIMEOUT_S, "the orphaned step's end", POLL_S)


def stack_down_up(bench: Bench, name: str) -> Outcome:
    """``infra.stack.down`` under the experiment, ``infra.stack.up``, then continue it (or
    measure the same flow, if it survived)."""
    flow, log = bench.launch(name)
    try:
        run_id = midway(bench, name, flow)
        offset = log.stat().st_size
        newest = bench.newest_step(run_id)  # MLflow goes down with the stack
        fault_at = time.time()
        stack_lib.down(bench.config)
        ports_free(bench.config)
        outcome = Outcome("stack", fault_at, time.time())
        stack_lib.up(bench.config)
        ended = next_metric(bench, run_id, outcome, flow, newest)
        if ended is None or ended == 0:  # it survived: its own next metric
            outcome.continued = "the same flow (it survived)"
            text = finished(flow, log, "the flow after the stack's restart", outcome)
            return _settled(bench, name, run_id, outcome, text[offset:])
        outcome.notes.append(f"the flow ended {ended} under the stack's restart")
    finally:
        _killed(flow)
    return continued(bench, name, run_id, outcome)


def ports_free(config: StackConfig) -> None:
    """Wait until no one listens on the stack's ports (``up`` refuses a taken one); what
    holds one after 30 s is printed before ``up`` says so."""
    ports = [config.s3_port, config.master_port, config.volume_port, config.filer_port]
    ports += [p + config.seaweed_grpc_shift for p in ports]
    ports += [config.mlflow_port, config.prefect_port, config.dask_port]

    def taken() -> list[int]:
        return [p for p in ports if port_open(p, config.host)]

    with contextlib.suppress(RuntimeError):
        until(lambda: not taken(), 30, "the stack's ports free", POLL_S)
    if taken():
        listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        held = [line for line in listening.splitlines() if any(f":{p} " in line for p in taken())]
        print(f"      ports still taken after down: {taken()}: {held}", flush=True)


def continued(bench: Bench, name: str, run_id: str, outcome: Outcome) -> Outcome:
    """The same command with ``--activate KEY``; from its start to the next metric too."""
    key = experiment_key(bench, name)
    outcome.continued = "--activate"
    newest = bench.newest_step(run_id)
    outcome.continue_at = time.time()
    flow, log = bench.launch(name, "--activate", key)
    try:
        next_metric(bench, run_id, outcome, flow, newest)  # a failure: finished says it
        text = finished(flow, log, "the continued experiment", outcome)
    finally:
        _killed(flow)
    return _settled(bench, name, run_id, outcome, text)


def _settled(bench: Bench, name: str, run_id: str, outcome: Outcome, log_after: str) -> Outcome:
    outcome.last_before = last_stamped_before(bench, run_id, outcome.restart_at)
    outcome.resumed = resumed_at(bench, log_after, run_id)
    outcome.misses = check(bench, name, run_id)
    return outcome


def _killed(flow: subprocess.Popen[bytes]) -> None:
    """A flow the bench gives up on is not left running."""
    if flow.poll() is None:
        flow.kill()
        flow.wait()


RUNS: dict[str, Callable[[Bench, str], Outcome]] = {
    "scheduler": scheduler_restart,
    "launcher": launcher_killed,
    "stack": stack_down_up,
}
WHAT = {
    "scheduler": "scheduler SIGKILLed, restarted",
    "launcher": "launcher SIGKILLed, --activate",
    "stack": "stack down, up, continued",
}


def print_outcome(repeat: int, x: Outcome) -> None:
    replayed = "?" if x.replayed is None else str(x.replayed)
    if x.metric_step >= 0:
        metric = (
            f"next training metric (batch {x.metric_step}) {x.from_restart_s:.1f} s after the "
            f"restart, {x.from_fault_s:.1f} s after the fault"
        )
        if x.continue_at is not None and x.fault != "launcher":
            metric += f", {x.metric_at - x.continue_at:.1f} s after the continue command"
    else:
        metric = "no training metric after the restart"
    if x.workers_at is not None and x.fault != "launcher":
        metric += f"; every worker registered again {x.workers_at - x.restart_at:.1f} s after it"
    resumed = "warm (still held)" if x.resumed == "warm" else f"from the checkpoint at {x.resumed}"
    print(
        f"   {WHAT[x.fault]}, repeat {repeat}: {metric}; went on by {x.continued}; ended "
        f"{x.done_at - x.restart_at:.1f} s after the restart; last batch before the restart "
        f"{x.last_before}, resumed {resumed}; replayed {replayed}; "
        f"{'MISS: ' + '; '.join(x.misses) if x.misses else 'all correct'}"
        + "".join(f"\n      {note}" for note in x.notes),
        flush=True,
    )


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):5.1f} s" if values else "    -  "


def print_medians(done: list[Outcome]) -> None:
    print("medians (s; -: no training metric came after the restart):")
    for fault in FAULTS:
        of = [x for x in done if x.fault == fault]
        if not of:
            continue
        came = [x for x in of if x.metric_step >= 0]
        print(
            f"   {WHAT[fault]:<32} restart -> metric {_median([x.from_restart_s for x in came])}"
            f"; fault -> metric {_median([x.from_fault_s for x in came])}; restart -> "
            f"ended {_median([x.done_at - x.restart_at for x in of])}; replayed "
            f"{[x.replayed for x in of]}; misses {sum(1 for x in of if x.misses)} of {len(of)}"
        )


def machine_line() -> str:
    """Cores, load, and leftover Dask workers or flows of anyone's (a busy machine)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    workers = sum("dask_worker" in line or "dask-worker" in line for line in ps.splitlines())
    flows = sum("flows.experiment" in line for line in ps.splitlines())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    busy = "BUSY" if os.getloadavg()[0] > (os.cpu_count() or 1) else "idle enough"
    return (
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; load average (1, 5, 15 min) {load} ({busy}); running "
        f"before the bench: {workers} Dask worker and {flows} flow processes (others')"
    )


@contextlib.contextmanager
def own_stack(root: Path, offset: int) -> Iterator[tuple[StackConfig, dict[str, str]]]:
    config = stack_config(root, offset)
    try:
        print("starting a stack of its own (about a minute)...", file=sys.stderr, flush=True)
        yield config, stack_lib.up(config)
    finally:
        stack_lib.down(config)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="per fault (default 2)")
    parser.add_argument("--down-s", type=float, default=5.0, help="scheduler away (default 5)")
    parser.add_argument("--sleep-s", type=float, default=0.2, help="per batch (default 0.2)")
    parser.add_argument("--past", type=int, default=15, help="batches past the checkpoint")
    parser.add_argument("--faults", default=",".join(FAULTS), help="which, comma-separated")
    parser.add_argument("--keep", type=Path, help="a folder for the stack and the flows' logs")
    parser.add_argument(
        "--port-offset", type=int,
        default=PORTS,
        help=f"added to bench/det_latency.py's ports (default {PORTS}: below the ephemeral range)",
    )  # fmt: skip
    args = parser.parse_args()
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    return args


def main() -> int:
    args = parse()
    print(machine_line(), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the stack's teardown runs
    done: list[Outcome] = []
    with (
        contextlib.nullcontext(str(args.keep))
        if args.keep
        else tempfile.TemporaryDirectory(prefix="bench-faults-") as folder
    ):
        tmp = Path(folder)
        with own_stack(tmp / "stack", args.port_offset) as (config, env):
            bench = Bench(config, env, tmp, args)
            loss, took = undisturbed(bench)
            print(f"undisturbed run: {took:.1f} s, final validation loss {loss!r}", flush=True)
            for i in range(args.repeats):
                for fault in args.faults.split(","):
                    try:
                        outcome = RUNS[fault](bench, f"fault-bench-{fault}-{i + 1}")
                    except Exception as err:  # a MISS: said, and the bench goes on
                        print(f"   {WHAT[fault]}, repeat {i + 1}: MISS: {err}", flush=True)
                        continue
                    print_outcome(i + 1, outcome)
                    done.append(outcome)
    print_medians(done)
    print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
