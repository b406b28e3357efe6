"""Data-parallel training on 2 CPU processes (Gloo), through `det-tasks run` and its
launchers, for both backends: weights equal the single-process run's after every optimizer
step, a custom MetricReducer over uneven shards equals the single-process value, resume
across world sizes is exact, and a failing rank fails the trial with its error."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "distributed_model"
BACKENDS = [
    "torch",
    pytest.param(
        "horovod",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("horovod") is None,
            reason="Horovod is not installed (make horovod)",
        ),
    ),
]

pytestmark = pytest.mark.distributed


def run(model: Path, out: Path, *params: str, resume: Path | None = None) -> tuple[int, str, dict]:
    """`det-tasks run` on the fixture; returns (exit code, output, the chief's summary)."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    argv = [
        sys.executable, "-m", "det_tasks.runner.cli", "run", str(model / "line.yaml"),
        "--no-progress", "--checkpoint-dir", str(out / "checkpoints"),
        "--summary-file", str(summary), "--param", f"data.out_dir={out}", *
        [a for p in params for a in ("--param", p)],
        *(["--resume", str(resume)] if resume else []),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, data


def weights(out: Path, rank: int) -> list[tuple[int, list[float]]]:
    lines = (out / f"weights-rank{rank}.jsonl").read_text().splitlines()
    return [(r["batch"], r["w"]) for r in map(json.loads, lines)]


def assert_same_weights(a, b, tol: float = 1e-6) -> None:
    assert [step for step, _ in a] == [step for step, _ in b]
    for (_, wa), (_, wb) in zip(a, b):
        assert wa == pytest.approx(wb, abs=tol)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("line-model")
    shutil.copy(FIXTURE / "model_def.py", model)
    shutil.copy(FIXTURE / "line.yaml", model)
    return model


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    code, log, summary = run(model, out, "resources.slots_per_trial=1")
    assert code == 0, log
    return out, summary


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_match_one_process_every_step(model, single, tmp_path, backend):
    single_out, single_summary = single
    code, log, summary = run(model, tmp_path, f"resources.distributed_backend={backend}")
    assert code == 0, log
    # 12 batches, aggregation frequency 2: 6 optimizer steps, identical on both ranks and
    # equal to one process over the same global batches.
    rank0, rank1 = weights(tmp_path, 0), weights(tmp_path, 1)
    assert [step for step, _ in rank0] == [2, 4, 6, 8, 10, 12]
    assert rank0 == rank1
    assert_same_weights(rank0, weights(single_out, 0))
    # Validation: 10 records in per-slot batches of 3 dealt to 2 ranks (6 + 4 records):
    # the reducer's cross-slot value equals the single-process one.
    assert summary["validation"]["val_count"] == 10
    assert summary["validation"]["val_mse"] == pytest.approx(
        single_summary["validation"]["val_mse"], rel=1e-6
    )
    # Only the chief writes checkpoints (one directory per checkpoint, 2 of them).
    saved = [p for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert len(saved) == 2
    assert summary["batches_trained"] == 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_two_rank_checkpoint_on_two_ranks_and_on_one(model, single, tmp_path, backend):
    first = tmp_path / "first"
    code, log, _ = run(
        model, first, f"resources.distributed_backend={backend}", "searcher.max_length.batches=6"
    )
    assert code == 0, log
    (checkpoint,) = [p for p in (first / "checkpoints").iterdir() if not p.name.startswith(".")]
    full = weights(single[0], 0)
    for name, params in (
        ("two", [f"resources.distributed_backend={backend}"]),
        ("one", ["resources.slots_per_trial=1"]),
    ):
        out = tmp_path / name
        code, log, summary = run(model, out, *params, resume=checkpoint)
        assert code == 0, log
        assert summary["batches_trained"] == 12
        assert_same_weights(weights(out, 0), full[3:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_rank_fails_the_trial_with_its_error_and_leaves_no_worker(
    model, tmp_path, backend
):
    started = time.monotonic()
    code, log, summary = run(
        model,
        tmp_path,
        f"resources.distributed_backend={backend}",
        "data.fail_rank=1",
        "data.fail_at_batch=3",
    )
    elapsed = time.monotonic() - started
    assert code != 0 and summary == {}
    assert "RuntimeError: rank 1 boom at 3" in log
    print(f"{backend}: failing rank -> trial failed in {elapsed:.1f}s")
    leftover = subprocess.run(
        ["pgrep", "-f", f"data.out_dir={tmp_path}"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", "a worker outlived the failed trial"


@pytest.mark.parametrize("backend", BACKENDS)
def test_terminating_the_launcher_stops_every_worker(model, tmp_path, backend):
    """A flow task cancelled (SIGTERM) mid-training must not leave ranks running: horovodrun
    starts each rank in a process group of its own, so killing one group is not enough."""
    argv = [
        sys.executable, "-m", "det_tasks.runner.cli", "run", str(model / "line.yaml"),
        "--no-progress", "--checkpoint-dir", str(tmp_path / "checkpoints"),
        "--param", f"data.out_dir={tmp_path}", "--param", "searcher.max_length.batches=100000",
        "--param", f"resources.distributed_backend={backend}",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "weights-rank1.jsonl").exists():  # both ranks are training
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    proc.terminate()
    assert proc.wait(timeout=60) != 0
    time.sleep(0.5)
    leftover = subprocess.run(
        ["pgrep", "-f", f"data.out_dir={tmp_path}"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", "a worker outlived its terminated launcher"
