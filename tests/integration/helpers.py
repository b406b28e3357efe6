"""What several integration tests share: the test stacks' ports, an environment that names
no platform service (and one with a home of its own), this process's environment changed for
a while and then put back whole, a Ctrl-C (or another signal) midway through a run, and a
quick `det-tasks run` of the flow tests' XOR trial (its weights when never stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infra.stack import StackConfig

REPO = Path(__file__).resolve().parents[2]
FLOW_MODEL = REPO / "tests" / "fixtures" / "flow_model"
PLATFORM_PREFIXES = ("MLFLOW_", "AWS_", "PREFECT_", "DET_TASKS_")


@contextmanager
def environment(replace: dict[str, str] | None = None, **changes: str) -> Iterator[None]:
    """This process's environment with ``changes`` (or, given ``replace``, only that and the
    changes) until the block ends; then exactly what it was, whatever the block set. For a
    session fixture or part of a test, where monkeypatch's scope does not fit."""
    saved = dict(os.environ)
    try:
        if replace is not None:
            os.environ.clear()
            os.environ.update(replace)
        os.environ.update(changes)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def isolated_stack_config(root: Path, offset: int = 0, **settings: Any) -> StackConfig:
    """A stack on the tests' ports (apart from a developer's `make up` stack); each extra
    stack a test starts beside the session's takes its own ``offset``.
    ``DET_TASKS_TEST_PORT_OFFSET`` shifts them all, so two checkouts can test at once."""
    offset += int(os.environ.get("DET_TASKS_TEST_PORT_OFFSET", "0"))
    return StackConfig(
        root=root,
        s3_port=28333 + offset,
        master_port=29334 + offset,
        volume_port=28181 + offset,
        filer_port=28989 + offset,
        mlflow_port=25001 + offset,
        prefect_port=24200 + offset,
        dask_port=28786 + offset,
        # gRPC at 13333/14334/13181/13989 (+offset): out of the ephemeral port range, and
        # apart from a `make up` stack's 18333/19334/18081/18889.
        seaweed_grpc_shift=-15000,
        **settings,
    )


def env_without_platform(**extra: str) -> dict[str, str]:
    """This process's environment minus every MLflow/S3/Prefect/det-tasks variable, plus
    ``extra``: a child that sees only what the test gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PLATFORM_PREFIXES)}
    return {**env, **extra}


def home_env(home: Path) -> dict[str, str]:
    """No platform service, this checkout importable, and a home (det_tasks' and Prefect's)
    of its own under ``home``: a run without servers, as a user's first one."""
    return env_without_platform(
        DET_TASKS_HOME=str(home / "det"),
        PREFECT_HOME=str(home / "prefect"),
        PYTHONPATH=str(REPO),
    )


def ctrl_c_midway(proc: subprocess.Popen[str], pid_file: Path, after_s: float) -> tuple[str, float]:
    """SIGINT to ``proc``'s process group (a terminal's Ctrl-C; start it with
    ``start_new_session=True``) ``after_s`` seconds after its trial wrote ``pid_file``;
    its stderr and the seconds from the signal to its exit (AssertionError after 120 s)."""
    return signal_midway(proc, pid_file, after_s)


def signal_midway(
    proc: subprocess.Popen[str],
    pid_file: Path,
    after_s: float,
    signum: int = signal.SIGINT,
    group: bool = True,
) -> tuple[str, float]:
    """``signum`` to ``proc``'s process group (or, ``group=False``, to ``proc`` alone)
    ``after_s`` seconds after its trial wrote ``pid_file``; its stderr and the seconds from
    the signal to its exit (AssertionError after 120 s)."""
    deadline = time.monotonic() + 300
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()[1][-3000:]
    time.sleep(after_s)
    signalled = time.monotonic()
    if group:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired as late:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        name = signal.Signals(signum).name
        raise AssertionError(f"still running 120 s after {name}:\n{late.stderr!r:.6000}") from None
    return stderr, time.monotonic() - signalled


def newest_weights(home: Path, checkpoints: Path) -> dict[str, Any]:
    """The model weights of the newest checkpoint in ``checkpoints``, loaded as in ``home``
    (whose key signed it)."""
    from det_tasks import pytorch

    newest = max(checkpoints.glob("*/metadata.json"), key=lambda p: p.stat().st_mtime)
    with environment(replace=home_env(home)):
        trial = pytorch.load_trial_from_checkpoint_path(str(newest.parent))
    return dict(trial.model.state_dict())


def undisturbed_weights(home: Path, *params: str) -> dict[str, Any]:
    """The flow fixture's killable trial (with ``params``, as ``--param`` values) trained in
    one ``det-tasks run`` that is never stopped: its final weights, the known answer for a
    stopped and continued run."""
    reference_dir = home / "reference"
    command = [sys.executable, "-m", "det_tasks.runner.cli", "run"]
    command += [str(FLOW_MODEL / "killable.yaml"), str(FLOW_MODEL), "--no-progress"]
    command += ["--checkpoint-dir", str(reference_dir)]
    command += [arg for param in params for arg in ("--param", param)]
    done = subprocess.run(
        command, cwd=home, env=home_env(home), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return newest_weights(home, reference_dir)


def run_xor_trial(
    name: str, batches: int, env: dict[str, str], model_dir: Path = FLOW_MODEL, *args: str
) -> subprocess.CompletedProcess[str]:
    """`det-tasks run` of the XOR trial (no sleeps) as experiment ``name``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(model_dir / "killable.yaml"),
            str(model_dir),
            "--no-progress",
            "--param",
            f"name={name}",
            "--param",
            "hyperparameters.sleep_s=0",
            "--max-batches",
            str(batches),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def flow_experiment(config: str, *overrides: str) -> subprocess.Popen[str]:
    """``python -m flows.experiment`` of a flow tests' config against the stack (its
    variables are in this process's environment while the ``stack`` fixture lives), as a
    second user types it."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(FLOW_MODEL / config), *overrides],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    """``condition()``'s first true value, polled every 0.5 s; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def group_alive(pgid: int) -> list[str]:
    """Processes of the group ``pgid`` still alive (an exited, not yet reaped one is not)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return [" ".join(r) for r in rows if r[0] == str(pgid) and not r[1].startswith("Z")]


def killable_runs(home: Path) -> list[Any]:
    """Every MLflow run of the flow fixture's ``flow-killable`` experiment in ``home``'s
    store (a run without servers)."""
    from registry.runs.tracking import client_for

    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("flow-killable")
    assert experiment is not None
    return client.search_runs([experiment.experiment_id])


def paused_at_the_stop_batch(home: Path, batches: int = 120) -> tuple[list[Any], Any, Any]:
    """Assert a paused run of the flow fixture's killable trial in ``home``: every run ended
    KILLED with det.state PAUSED, and the trial's last checkpoint is at the batch it stopped
    at, before its ``batches``. Returns (the runs, the trial's run, the MLflow client)."""
    from registry.checkpoints.store import checkpoint_records
    from registry.runs.tracking import client_for

    runs = killable_runs(home)
    assert {r.info.status for r in runs} == {"KILLED"}
    assert {r.data.tags.get("det.state") for r in runs} == {"PAUSED"}
    trial = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    stopped_at = int(trial.data.metrics["progress/batches"])
    steps = [r["steps_completed"] for r in checkpoint_records(client, trial.info.run_id)]
    assert 0 < stopped_at < batches
    assert steps[-1] == stopped_at  # the pause checkpoint, at the stop batch
    return runs, trial, client
