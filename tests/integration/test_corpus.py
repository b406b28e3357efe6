"""A held-out corpus of trials written as teams write Determined ``PyTorchTrial``s
(``tests/fixtures/corpus/<name>/``: loader worker processes, gradient accumulation, GANs,
LR schedules, file-writing callbacks, side files, nested hyperparameters, reducers,
subprocesses, odd names, epoch and record lengths), each with answers known in advance.

Each runs through ``det-tasks run`` (``run_trial``, the function the command calls, for
its whole metric history; and as the command itself), and (slow) through
``python -m flows.experiment`` with no servers (on a home's warm services) and, for the
cases the stack's set-up changes, on the stack. The flows' final metrics must equal
``det-tasks run``'s for the same seed.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from det_tasks.runner import run_trial
from tests.integration.helpers import REPO, ctrl_c_midway, home_env, wait_for

CORPUS = REPO / "tests" / "fixtures" / "corpus"
Series = list[tuple[int, float]]


@dataclasses.dataclass(frozen=True)
class Observed:
    """What one trial reported, however it ran: metric -> [(batches, value)] per group,
    and the folder its ``data`` output setting pointed at."""

    batches: int
    training: dict[str, Series]
    validation: dict[str, Series]
    out: Path

    def series(self, name: str, group: str = "validation") -> Series:
        return getattr(self, group)[name]

    def steps(self, name: str, group: str = "validation") -> list[int]:
        return [step for step, _ in self.series(name, group)]

    def values(self, name: str, group: str = "validation") -> list[float]:
        return [value for _, value in self.series(name, group)]

    def final(self, name: str) -> float:
        return self.series(name)[-1][1]


def _pivot(reports: list[tuple[int, dict[str, Any]]]) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for step, metrics in reports:
        for name, value in metrics.items():
            out.setdefault(name, []).append((step, float(value)))
    return out


def _fixture_module(case: str) -> ModuleType:
    """A corpus trial's model_def, imported under a name of its own (for its data)."""
    from det_tasks import compat

    compat.install()
    path = CORPUS / case / "model_def.py"
    spec = importlib.util.spec_from_file_location(f"corpus_{case}_model_def", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the known answers, one function per trial ------------------------------------------
def check_loader_workers(o: Observed) -> None:
    assert o.batches == 24 and o.steps("validation_mse") == [8, 16, 24]
    # EvenThenOddSampler: each 8-batch epoch is 4 batches of even rows, then 4 of odd ones;
    # scheduling_unit: 4 reports training metrics every 4 batches.
    assert o.series("odd_rows", "training") == [(4 * k, float(k % 2 == 0)) for k in range(1, 7)]
    # collate_rows ran in the loader's worker processes, for training and validation.
    assert set(o.values("in_worker", "training")) == {1.0} and o.final("in_worker") == 1.0


def check_grad_accumulation(o: Observed) -> None:
    # Four batches per optimizer step, lr 0.5: w = 1 - 0.5**steps, two steps per validation.
    assert o.series("weight") == [(8, 0.75), (16, 0.9375), (24, 0.984375)]


def check_aggregation_frequency(o: Observed) -> None:
    # aggregation_frequency 3: one optimizer step per 3 batches, the lr halving after each.
    assert o.series("lr", "training") == [(i + 1, 0.5 * 0.5 ** (i // 3)) for i in range(12)]
    assert o.final("weight") == pytest.approx(1 - 0.5 * 0.75 * 0.875 * 0.9375, abs=1e-7)


def check_gan(o: Observed) -> None:
    assert o.batches == 48 and o.steps("mean_gap") == [16, 32, 48]  # 8 batches an epoch
    assert {"d_loss", "g_loss", "fake_mean"} <= set(o.training)
    assert {"mean_gap", "d_real", "d_fake"} <= set(o.validation)
    assert all(0 < v < 1 for v in o.values("d_real") + o.values("d_fake"))


def check_lr_schedulers(o: Observed) -> None:
    # LambdaLR warm-up stepped every batch; StepLR halving every 5-batch epoch; the
    # plateau scheduler (MANUAL_STEP, patience 100) never changes the head's rate.
    assert o.steps("backbone_lr", "training") == list(range(1, 16))
    warmup = [0.2 * min(1.0, (i + 1) / 4) for i in range(15)]
    assert o.values("backbone_lr", "training") == pytest.approx(warmup)
    assert o.series("head_lr", "training") == [(i + 1, 0.4 * 0.5 ** (i // 5)) for i in range(15)]
    assert o.steps("validation_loss") == [5, 10, 15]


def check_callbacks_csv(o: Observed) -> None:
    with open(o.out / "trial-1-validations.csv", newline="") as f:
        rows = list(csv.reader(f))
    losses = o.values("validation_loss")
    assert rows == [
        ["batch", "validations", "validation_loss"],
        *(
            [str(b - 1), str(n), f"{v:.6f}"]
            for n, (b, v) in enumerate(zip(o.steps("validation_loss"), losses), 1)
        ),
    ]
    assert o.steps("validation_loss") == [5, 10, 15, 20]
    assert o.values("epochs_started") == [1.0, 2.0, 3.0, 4.0]  # a 5-batch epoch
    assert set(o.values("first_batch")) == {0.0}


def check_side_files(o: Observed) -> None:
    # vocab.json (beside model_def.py) and labels.txt (the working directory) were found:
    # the trial built its model from them and separates the reviews.
    assert o.steps("accuracy") == [6, 12, 18, 24, 30] and o.final("accuracy") == 1.0


def check_hparams_config(o: Observed) -> None:
    seen = json.loads((o.out / "seen.json").read_text())
    optimizer = {"lr": 0.05, "momentum": 0.9, "name": "sgd"}
    data = {
        "features": ["a", "b", "c"],
        "report_dir": str(o.out),
        "seed": 4,
        "train_rows": 96,
        "validation_rows": 24,
    }
    assert seen == {
        "hparams": {
            "global_batch_size": 12,
            "model": {"activation": "tanh", "layers": [16, 8]},
            "optimizer": optimizer,
        },
        "optimizer": optimizer,
        "global_batch_size": 12,
        "per_slot_batch_size": 12,
        "data": data,
        "name": "corpus-hparams-config",
        "searcher_metric": "validation_mse",
        "max_length": {"epochs": 4},
        "config_data_is_data_config": True,
        "smaller_is_better": True,
        "slots_per_trial": 1,
        "scheduling_unit": 100,
        "trial_id": 1,
    }
    assert o.batches == 32 and o.steps("validation_mse") == [16, 32]  # 8 batches an epoch


def check_reducers(o: Observed) -> None:
    labels = _fixture_module("reducers").labelled(36, seed=1).tensors[1]
    assert o.steps("f1") == [12, 24]
    assert o.values("records") == [36.0, 36.0]  # Reducer.SUM over the 5 batches
    assert o.values("positives") == [float(labels.sum())] * 2  # the MetricReducer's counts
    for at in range(2):
        p, r, f1 = (o.values(m)[at] for m in ("precision", "recall", "f1"))
        assert f1 == pytest.approx(2 * p * r / (p + r))
        assert o.values("worst_batch_error")[at] >= o.values("best_batch_error")[at]
        assert 0 <= o.values("correct")[at] <= 36 and 0 <= o.values("median_abs_error")[at] < 1
    # The training reducer sums records per report: 6 batches of 8 (scheduling_unit: 6).
    assert o.series("records_trained", "training") == [
        (6, 48.0),
        (12, 48.0),
        (18, 48.0),
        (24, 48.0),
    ]


def check_subprocesses(o: Observed) -> None:
    module = _fixture_module("subprocesses")
    x, _ = module.raw_inputs(32, seed=1)
    batch_sums = module.featurize(x).split(16)
    assert set(o.values("probe_answer")) == {42.0}  # subprocess.run in __init__
    # The pool's features (validation: two batches of 16, averaged).
    expected = sum(float(b.sum()) for b in batch_sums) / 2
    assert o.values("feature_sum") == pytest.approx([expected] * 2, rel=1e-6)
    assert o.steps("validation_mse") == [16, 32]


def check_odd_names(o: Observed) -> None:
    # Not recall@1/recall@2 here: MLflow refuses '@' (test_flow_records_every_metric_name).
    assert o.steps("val/loss") == [15, 30] and o.final("top-1.acc") == 1.0
    assert {"train/loss", "grad-norm"} <= set(o.training)


def check_iterable_stream(o: Observed) -> None:
    # An infinite IterableDataset of (1, 1) through a plain torch DataLoader: 60 batches
    # (max_length in batches), the one-variable weight's closed form at each validation.
    assert o.batches == 60 and o.steps("validation_loss") == [20, 40, 60]
    assert o.values("weight") == pytest.approx([1 - 0.9**n for n in (20, 40, 60)], rel=1e-5)


def _timeline(o: Observed) -> list[list[Any]]:
    return [json.loads(line) for line in (o.out / "timeline-1.jsonl").read_text().splitlines()]


def check_lengths_epochs(o: Observed) -> None:
    # max_length 3 epochs of a 5-batch loader; validation every epoch.
    assert o.batches == 15 and o.steps("validation_loss") == [5, 10, 15]
    assert _timeline(o) == [
        x for e in range(3) for x in (["epoch_end", e], ["validation_at", 5 * (e + 1)])
    ]


def check_lengths_records(o: Observed) -> None:
    # 120 records / 8 = 15 batches; validation every 48 records (6 batches). Epoch ends stay
    # the loader's (5 batches), as in Determined.
    assert o.batches == 15 and o.steps("validation_loss") == [6, 12, 15]
    assert _timeline(o) == [
        ["epoch_end", 0],
        ["validation_at", 6],
        ["epoch_end", 1],
        ["validation_at", 12],
        ["epoch_end", 2],
        ["validation_at", 15],
    ]


@dataclasses.dataclass(frozen=True)
class Case:
    folder: str
    check: Callable[[Observed], None]
    config: str = "const.yaml"
    out_key: str | None = None  # data.<out_key> is pointed at the test's output folder
    flow_overrides: tuple[str, ...] = ()  # for the flows' runs only

    @property
    def id(self) -> str:
        return (
            self.folder
            if self.config == "const.yaml"
            else f"{self.folder}-{Path(self.config).stem}"
        )

    def overrides(self, out: Path) -> list[str]:
        return [f"data.{self.out_key}={out}"] if self.out_key else []

    def flow_args(self, out: Path) -> list[str]:
        return [*self.overrides(out), *self.flow_overrides]


CASES = [
    Case("loader_workers", check_loader_workers),
    Case("grad_accumulation", check_grad_accumulation),
    Case("aggregation_frequency", check_aggregation_frequency),
    Case("gan", check_gan),
    Case("lr_schedulers", check_lr_schedulers),
    Case("callbacks_csv", check_callbacks_csv, out_key="out_dir"),
    Case("side_files", check_side_files),
    Case("hparams_config", check_hparams_config, out_key="report_dir"),
    Case("reducers", check_reducers),
    # A known gap (docs/migrating.md): a torch.multiprocessing Pool forked inside a flow's
    # Dask worker (a process with several threads) hung in 1 of 3 CI-like runs, and the
    # stuck trial then held its warm worker. Until that is fixed the flows featurize in the
    # trial's own process (the same features); det-tasks run keeps the pool.
    Case("subprocesses", check_subprocesses, flow_overrides=("data.pool_size=0",)),
    Case("odd_names", check_odd_names),
    Case("lengths", check_lengths_epochs, out_key="log_dir"),
    Case("lengths", check_lengths_records, config="records.yaml", out_key="log_dir"),
    Case("iterable_stream", check_iterable_stream),
]
BY_ID = {case.id: case for case in CASES}
# The corpus sets pin_memory=True on CPU on purpose (as teams do); torch says it is unused.
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")


def _run_locally(case: Case, tmp_path: Path, *more: str, **kwargs: Any) -> tuple[Observed, Any]:
    """``det-tasks run``'s function, with the trial's output folder and checkpoints in
    ``tmp_path``; run from the test's own directory, so the trial finds its side files only
    by its model directory."""
    out = tmp_path / "out"
    result = run_trial(
        CORPUS / case.folder / case.config,
        checkpoint_dir=tmp_path / "checkpoints",
        overrides=[*case.overrides(out), *more],
        progress=False,
        **kwargs,
    )
    observed = Observed(
        result.batches_trained, _pivot(result.sink.training), _pivot(result.sink.validation), out
    )
    return observed, result


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is not the model directory (nor the repository)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_det_tasks_run_gives_the_known_answers(case: Case, tmp_path: Path, elsewhere: Path) -> None:
    observed, _ = _run_locally(case, tmp_path)
    case.check(observed)
    assert Path.cwd() == elsewhere  # the trial ran in its model directory, and came back


def test_a_trials_child_processes_keep_default_signals(tmp_path: Path, elsewhere: Path) -> None:
    """A process the trial starts may be stopped with SIGTERM (Pool.terminate, Popen)."""
    observed, _ = _run_locally(BY_ID["subprocesses"], tmp_path)
    assert set(observed.values("probe_sigterm_default")) == {1.0}


def test_gan_checkpoint_holds_both_models_and_both_optimizers(
    tmp_path: Path, elsewhere: Path
) -> None:
    from det_tasks.pytorch import load_trial_from_checkpoint_path

    _, result = _run_locally(BY_ID["gan"], tmp_path)
    path = tmp_path / "checkpoints" / result.checkpoint_uuid
    state = torch.load(path / "state_dict.pth", weights_only=True)
    assert len(state["models_state_dict"]) == 2 and len(state["optimizers_state_dict"]) == 2
    trial = load_trial_from_checkpoint_path(str(path))
    generator = state["models_state_dict"][0]
    assert torch.equal(trial.generator[0].weight, generator["0.weight"])


def test_callback_state_and_files_survive_a_resume(tmp_path: Path, elsewhere: Path) -> None:
    case = BY_ID["callbacks_csv"]
    first, result = _run_locally(case, tmp_path)
    note = json.loads((tmp_path / "checkpoints" / result.checkpoint_uuid / "note.json").read_text())
    assert note == {"batch": 19, "hparams": {"global_batch_size": 8, "lr": 0.3}}
    resumed, _ = _run_locally(
        case, tmp_path, "searcher.max_length.batches=30", latest_checkpoint=result.checkpoint_uuid
    )
    rows = list(csv.reader((first.out / "trial-1-validations.csv").open()))
    # The CSV callback's count came back from the checkpoint (state_dict/load_state_dict).
    assert [r[:2] for r in rows[5:]] == [["24", "5"], ["29", "6"]]
    assert resumed.steps("validation_loss") == [25, 30]
    assert set(resumed.values("first_batch")) == {20.0}  # on_trial_startup's first batch


def test_lr_schedules_resume_exactly(tmp_path: Path, elsewhere: Path) -> None:
    case = BY_ID["lr_schedulers"]
    whole, _ = _run_locally(case, tmp_path / "whole")
    part, first = _run_locally(case, tmp_path / "part", max_batches=7)
    rest, _ = _run_locally(
        case,
        tmp_path / "part",
        latest_checkpoint=str(tmp_path / "part" / "checkpoints" / first.checkpoint_uuid),
    )
    for name in ("backbone_lr", "head_lr"):
        joined = part.series(name, "training") + rest.series(name, "training")
        assert joined == whole.series(name, "training")
    assert rest.validation["validation_loss"][-1] == whole.validation["validation_loss"][-1]


def test_side_files_through_the_command_from_another_directory(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(CORPUS / "side_files" / "const.yaml"),
            "--checkpoint-dir",
            "checkpoints",  # relative: the user's directory, not the model directory
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["batches_trained"] == 30 and summary["validation"]["accuracy"] == 1.0
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.parent == tmp_path / "checkpoints"
    state = torch.load(checkpoint / "state_dict.pth", weights_only=True)["models_state_dict"][0]
    vocab = json.loads((CORPUS / "side_files" / "vocab.json").read_text())
    assert state["0.weight"].shape == (len(vocab), 8)  # EmbeddingBag over vocab.json
    assert state["1.weight"].shape == (2, 8)  # one output per line of labels.txt
    assert (checkpoint / "code" / "vocab.json").is_file()
    assert not (CORPUS / "side_files" / "checkpoints").exists()


# ---- the flow: no servers, and on the stack ----------------------------------------------
def _observed_in_mlflow(client: Any, summary: dict[str, Any], out: Path) -> Observed:
    """The trial's histories from its MLflow run (metrics ``training/x``, ``validation/x``)."""
    from registry.checkpoints.models import trial_runs

    match = re.search(r"runs/([0-9a-f]{32})", summary["mlflow_parent_run"])
    assert match, summary["mlflow_parent_run"]
    (trial,) = trial_runs(client, client.get_run(match.group(1)))
    groups: dict[str, dict[str, Series]] = {"training": {}, "validation": {}}
    for key in trial.data.metrics:
        group, _, name = key.partition("/")
        if group in groups:
            history = client.get_metric_history(trial.info.run_id, key)
            groups[group][name] = sorted((m.step, m.value) for m in history)
    return Observed(
        summary["best"]["batches_trained"], groups["training"], groups["validation"], out
    )


# Metrics that describe where the trial ran, not what it learned (each has its own test).
ENVIRONMENT_PROBES = {"probe_sigterm_default"}


# MLflow refuses some characters in a metric's name: registry.metrics.sink records the name with
# each of them as "_" (recall@1 as recall_1, the strict xfail below).
_REFUSED_BY_MLFLOW = re.compile(r"[^\w.\- :/]")


def _same_final_metrics(flow: Observed, local: Observed) -> None:
    """The flow's last validation equals det-tasks run's, for every metric MLflow holds."""
    assert flow.batches == local.batches
    assert flow.validation, "no validation metric reached MLflow"
    local_by_recorded_name = {
        _REFUSED_BY_MLFLOW.sub("_", n): s for n, s in local.validation.items()
    }
    for name, series in flow.validation.items():
        if name in ENVIRONMENT_PROBES:
            continue
        (step, value), (local_step, local_value) = series[-1], local_by_recorded_name[name][-1]
        assert step == local_step and value == pytest.approx(local_value, rel=1e-9), name


def _python(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ARGS`` in ``home``, a user's first home: no platform service set."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=home,
        env=home_env(home),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _flow(case: Case, home: Path, out: Path) -> tuple[Observed, dict[str, Any], str]:
    """``python -m flows.experiment`` of the case with no servers: what MLflow recorded of
    its trial, the printed summary, and stderr."""
    from registry.runs.tracking import client_for

    config = str(CORPUS / case.folder / case.config)
    proc = _python(home, "flows.experiment", config, *case.flow_args(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    client = client_for(f"sqlite:///{(home / 'det' / 'mlflow.db').resolve()}")
    return _observed_in_mlflow(client, summary, out), summary, proc.stderr


@pytest.fixture(scope="module")
def warm_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home with warm services (``python -m infra.warm_home start``): each experiment
    pays only its own process's start (a cold embedded run costs 20-50 s here), and every
    corpus trial (each a ``model_def``) trains on the same two warm workers in turn."""
    pytest.importorskip("mlflow")
    home = tmp_path_factory.mktemp("corpus-home")
    started = _python(home, "infra.warm_home", "start")
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield home
    finally:
        stopped = _python(home, "infra.warm_home", "stop")
        assert stopped.returncode == 0, stopped.stderr[-3000:]


FLOWS: dict[str, tuple[Observed, dict[str, Any]]] = {}  # case id -> its warm flow's result


def _warm_flow(case: Case, home: Path, out: Path) -> tuple[Observed, dict[str, Any]]:
    """The case's flow on the warm services, run once per session."""
    if case.id not in FLOWS:
        observed, summary, stderr = _flow(case, home, out)
        assert "on the warm services of" in stderr  # not a cold start of its own
        FLOWS[case.id] = (observed, summary)
    return FLOWS[case.id]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_flow_gives_the_known_answers_and_det_tasks_runs_metrics(
    case: Case, warm_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flow, summary = _warm_flow(case, warm_home, tmp_path / "flow-out")
    case.check(flow)
    monkeypatch.chdir(tmp_path)
    local, _ = _run_locally(case, tmp_path / "local")
    _same_final_metrics(flow, local)
    assert summary["best"]["trial_id"] == 1


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="MLflow refuses '@' in metric names: registry.metrics.sink records 'recall@1' as "
    "'recall_1' (with a warning), so the name the trial reported is not the one in MLflow",
)
def test_flow_records_every_metric_name(warm_home: Path, tmp_path: Path) -> None:
    flow, _ = _warm_flow(BY_ID["odd_names"], warm_home, tmp_path / "flow-out")
    assert {"recall@1", "recall@2"} <= set(flow.validation)


@pytest.mark.slow
def test_flow_trials_child_processes_keep_default_signals(warm_home: Path, tmp_path: Path) -> None:
    flow, _ = _warm_flow(BY_ID["subprocesses"], warm_home, tmp_path / "flow-out")
    assert set(flow.values("probe_sigterm_default")) == {1.0}


@pytest.fixture(scope="module")
def on_stack(stack: Any) -> Iterator[Any]:
    from registry.runs.tracking import client_for

    yield client_for(os.environ["MLFLOW_TRACKING_URI"])


# On the stack, the cases its set-up changes: workers started elsewhere (side files found
# by the working directory), trials that start processes, names in the MLflow server and
# S3 keys. The rest add time, not coverage, to a CI run.
STACK_CASES = [BY_ID[i] for i in ("loader_workers", "side_files", "odd_names")]


@pytest.mark.slow
@pytest.mark.parametrize("case", STACK_CASES, ids=[c.id for c in STACK_CASES])
def test_stack_gives_the_known_answers(case: Case, on_stack: Any, tmp_path: Path) -> None:
    """On the stack's own Dask workers (started from another directory), checkpoints in S3.
    ``det-tasks run`` gives the reference in a process of its own: this one ran a flow, and
    Prefect's exit hooks make its forked children (DataLoader workers) exit 1."""
    from flows.experiment import experiment

    out = tmp_path / "stack-out"
    summary = experiment(str(CORPUS / case.folder / case.config), case.flow_args(out))
    assert summary["best"]["checkpoint"].startswith("runs:/")
    stacked = _observed_in_mlflow(on_stack, summary, out)
    case.check(stacked)
    command = _det_tasks_run(case, tmp_path / "command")
    assert command["batches_trained"] == stacked.batches
    by_recorded_name = {_REFUSED_BY_MLFLOW.sub("_", n): v for n, v in command["validation"].items()}
    for name, series in stacked.validation.items():
        if name in ENVIRONMENT_PROBES:
            continue
        step, value = series[-1]
        assert step == stacked.batches, name
        assert value == pytest.approx(by_recorded_name[name], rel=1e-9), name


def _det_tasks_run(case: Case, folder: Path) -> dict[str, Any]:
    """The summary ``det-tasks run`` prints for the case, run in ``folder`` with no
    platform service (checkpoints and outputs there)."""
    folder.mkdir(parents=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "det_tasks.runner.cli",
            "run",
            str(CORPUS / case.folder / case.config),
            "--checkpoint-dir",
            str(folder / "checkpoints"),
            "--no-progress",
            *(f"--param={o}" for o in case.overrides(folder / "out")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
        env=home_env(folder),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# ---- a trial's own processes end with it (det_tasks.runner.trial_processes) --------------
HELPERS = CORPUS / "helper_processes" / "const.yaml"


def _helpers_left(marker: str) -> list[str]:
    """Processes still running (zombies are not) whose command line carries ``marker``."""
    import psutil

    left = []
    for process in psutil.process_iter(["cmdline", "status"]):
        args = process.info["cmdline"] or []
        if marker in args and process.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(f"{process.pid}: {' '.join(args)[:120]}")
    return left


def _helper_params(tmp_path: Path, batch_sleep: float = 0.0) -> tuple[str, Path, list[str]]:
    """A marker of the test's own for the trial's helpers, the file the trial writes once
    its three helpers run (their count), and the overrides that set both."""
    marker = f"corpus-helpers-{tmp_path.name}-{os.getpid()}"
    started = tmp_path / "helpers-started"
    params = [
        f"data.marker={marker}",
        f"data.started_file={started}",
        f"data.batch_sleep={batch_sleep}",
    ]
    return marker, started, params


def _det_tasks_run_command(folder: Path, params: list[str]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable,
        "-m",
        "det_tasks.runner.cli",
        "run",
        str(HELPERS),
        "--checkpoint-dir",
        str(folder / "checkpoints"),
        "--no-progress",
        *(f"--param={p}" for p in params),
    ]


def test_det_tasks_run_ends_the_trials_processes_with_it(tmp_path: Path) -> None:
    """A helper the trial starts in ``__init__`` (with a child and a setsid daemon of its
    own) is gone once ``det-tasks run`` exits: nothing is left to wait for."""
    marker, started, params = _helper_params(tmp_path)
    proc = subprocess.run(
        _det_tasks_run_command(tmp_path / "run", params),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=home_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert started.read_text() == "3"  # the helper and its two ran during the trial
    assert _helpers_left(marker) == []


def test_det_tasks_run_killed_takes_the_trials_processes_with_it(tmp_path: Path) -> None:
    """SIGKILL of ``det-tasks run`` (the OOM killer, ``kill -9``): its guard ends them."""
    marker, started, params = _helper_params(tmp_path, batch_sleep=1.0)
    proc = subprocess.Popen(
        _det_tasks_run_command(tmp_path / "run", params),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        env=home_env(tmp_path),
    )
    try:
        wait_for(started.exists, 300, "the trial's helpers to start")
        assert started.read_text() == "3" and proc.poll() is None
        time.sleep(1.0)  # training: the guard has looked at them (every 0.5 s)
        proc.kill()
        proc.wait()
        wait_for(lambda: not _helpers_left(marker), 15, "the trial's processes to end")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_flow_ends_the_trials_processes_when_it_finishes(warm_home: Path, tmp_path: Path) -> None:
    """On a warm worker, which outlives the trial: they end when the trial is released."""
    marker, started, params = _helper_params(tmp_path)
    proc = _python(warm_home, "flows.experiment", str(HELPERS), *params)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert started.read_text() == "3"
    assert _helpers_left(marker) == []


def _helpers_flow(home: Path, params: list[str], output: int) -> subprocess.Popen[str]:
    """``python -m flows.experiment`` of the helpers' trial in ``home``, in a process group
    of its own (a terminal's foreground job)."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.experiment", str(HELPERS), *params],
        cwd=home,
        env=home_env(home),
        stdout=output,
        stderr=output,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_flow_ends_the_trials_processes_on_ctrl_c(warm_home: Path, tmp_path: Path) -> None:
    """Ctrl-C pauses the experiment: its trial checkpoints and is released, and what it
    started (in the warm worker's process group, not the terminal's) ends with it."""
    marker, started, params = _helper_params(tmp_path, batch_sleep=1.0)
    proc = _helpers_flow(warm_home, params, subprocess.PIPE)
    stderr, _ = ctrl_c_midway(proc, started, after_s=2.0)
    assert proc.returncode == 130, stderr[-3000:]
    assert started.read_text() == "3"
    assert _helpers_left(marker) == []


@pytest.mark.slow
def test_flow_killed_takes_the_trials_processes_with_it(tmp_path: Path) -> None:
    """SIGKILL of the flow's main process (no servers, its own Dask workers): the workers
    exit as their Nanny goes, and each worker's guard ends what its trial started."""
    marker, started, params = _helper_params(tmp_path, batch_sleep=1.0)
    home = tmp_path / "home"
    home.mkdir()
    proc = _helpers_flow(home, params, subprocess.DEVNULL)
    try:
        wait_for(started.exists, 300, "the trial's helpers to start")
        assert started.read_text() == "3" and proc.poll() is None
        time.sleep(1.0)
        proc.kill()  # the main process only, as the OOM killer does
        proc.wait()
        wait_for(lambda: not _helpers_left(marker), 30, "the trial's processes to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever else of the flow is left


# ---- errors in the trial's data loading point at the trial's code -----------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("fail", "last_line"),
    [
        (
            "raise",
            r"error: trial 1 failed in __getitem__ at batch 2( after \d+ attempts)?: "
            r"ValueError: shard 11 is corrupt \(in DataLoader worker process 0\) "
            r"\(model_def\.py:24\)",
        ),
        (
            "kill",
            r"error: trial 1 failed in train at batch [12]( after \d+ attempts)?: DataLoader "
            r"worker process \(pid \d+\) was killed by signal 9 \(SIGKILL\): out of memory\? .*",
        ),
    ],
)
def test_flow_points_a_loader_workers_failure_at_the_trials_code(
    fail: str, last_line: str, warm_home: Path
) -> None:
    """A DataLoader worker process that raises in ``__getitem__``, or dies by a signal:
    the flow's error block names the user's frame (or the signal and its likely cause), and
    its "trial's code only" traceback holds the trial's frames only."""
    config = str(CORPUS / "failing_loader" / "const.yaml")
    proc = _python(warm_home, "flows.experiment", config, f"data.fail={fail}")
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = proc.stderr.rstrip().splitlines()
    assert re.fullmatch(last_line, lines[-1]), lines[-1]
    if fail == "raise":
        assert lines[-5:-1] == [
            "Traceback (the trial's code only):",
            '  File "model_def.py", line 24, in __getitem__',
            '    raise ValueError(f"shard {i} is corrupt")',
            "ValueError: shard 11 is corrupt (in DataLoader worker process 0)",
        ]
