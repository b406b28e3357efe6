"""A 2-slot ``det-tasks run`` (how a flow runs a multi-slot trial's segment) validates its
config once in all its processes: the launcher enters the file and hands the entered config
to both ranks as a file; started with a flow's entered config, no process parses or
validates it at all. Counted in every process by tests/fixtures/config_counter."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from det_tasks.config.entered import ENTERED_CONFIG_FLAG, enter_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPO = FIXTURES.parents[1]

pytestmark = pytest.mark.distributed


def _run(model: Path, out: Path, *extra: str) -> tuple[dict[str, collections.Counter[str]], dict]:
    """`det-tasks run` of the 2-slot fixture; (per process: its counted events, summary)."""
    out.mkdir(parents=True)
    counts = out / "counts.txt"
    counts.touch()
    argv = [
        sys.executable, "-m", "det_tasks.runner.cli", "run", str(model / "line.yaml"),
        "--no-progress", "--checkpoint-dir", str(out / "checkpoints"),
        "--summary-file", str(out / "summary.json"), *extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FIXTURES / "config_counter"), str(REPO)]),
        "CONFIG_COUNT_FILE": str(counts),
    }
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per_process: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in counts.read_text().splitlines():
        pid, kind = line.split()
        per_process[pid][kind] += 1
    return per_process, json.loads((out / "summary.json").read_text())


def _weights(out: Path, rank: int) -> list[str]:
    return (out / f"weights-rank{rank}.jsonl").read_text().splitlines()


def test_two_slots_validate_once_at_entry_and_never_from_an_entered_config(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(FIXTURES / "distributed_model" / "model_def.py", model)
    shutil.copy(FIXTURES / "distributed_model" / "line.yaml", model)

    entry_out = tmp_path / "entry"
    at_entry, _ = _run(model, entry_out, "--param", f"data.out_dir={entry_out}")
    validations = [c["validate"] for c in at_entry.values() if c["validate"]]
    assert validations == [1]  # the launcher only: its ranks read what it entered
    assert sum(c["yaml.load"] for c in at_entry.values()) == 2  # the file and its override

    flow_out = tmp_path / "flow"
    flow_out.mkdir()
    entered = enter_file(model / "line.yaml", [f"data.out_dir={flow_out / 'run'}"])
    given = entered.write(flow_out / "config.pickle")
    downstream, summary = _run(model, flow_out / "run", ENTERED_CONFIG_FLAG, str(given))
    assert sum(downstream.values(), collections.Counter()) == collections.Counter()
    assert summary["batches_trained"] == 12
    for rank in (0, 1):  # the same training, bit for bit
        assert _weights(flow_out / "run", rank) == _weights(entry_out, rank)
