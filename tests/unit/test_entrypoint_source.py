"""The flow's entrypoint check from the source (issue 53 item 4): what it refuses, it refuses
in the very words of the import-based check; what only an import can tell, it leaves to the
trial's worker, whose import error is final; and it imports neither the user's module nor
torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from det_tasks.config import ExperimentConfig
from det_tasks.config.entered import enter_file
from det_tasks.errors import ConfigError, DetTasksError, TrialError
from det_tasks.runner.entrypoint import load_trial_class_or_fail, model_dir_on_path
from det_tasks.runner.entrypoint_source import check_entrypoint_source
from det_tasks.runner.in_process import check_entrypoint

ROOT = Path(__file__).resolve().parents[2]
FLOW_MODEL = ROOT / "tests" / "fixtures" / "flow_model"


def _config(entrypoint: str) -> ExperimentConfig:
    _, cfg = enter_file(FLOW_MODEL / "killable.yaml", [f"entrypoint={entrypoint}"])
    return cfg


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model_def.py").write_text((FLOW_MODEL / "model_def.py").read_text())
    (tmp_path / "broken.py").write_text("class Trial:\n    def train_batch(self:\n")
    (tmp_path / "plain.py").write_text("class Plain:\n    def evaluate_batch(self): ...\n")
    (tmp_path / "raises.py").write_text("import os\n\nVALUE = 1 / 0\n\nclass T(object): ...\n")
    (tmp_path / "star.py").write_text("from model_def import *\n")
    (tmp_path / "patched.py").write_text("class P:\n    pass\n\nP.train_batch = print\n")
    (tmp_path / "train.py").write_text("print('a script')\n")
    return tmp_path


def _error(check: object, cfg: ExperimentConfig, model_dir: Path) -> tuple[type, str]:
    with pytest.raises(DetTasksError) as caught:
        check(cfg, model_dir)  # type: ignore[operator]
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("entrypoint", "says"),
    [
        ("nope:XorTrial", "no module 'nope' in model directory"),
        ("model_def:XorTrail", "model_def.py has no 'XorTrail'; classes defined there: XorData"),
        ("broken:Trial", "broken.py:2: "),
        ("plain:Plain", "is not a PyTorchTrial subclass"),
        ("python3 missing.py", "entrypoint script 'missing.py' not found"),
    ],
)
def test_refused_in_the_words_of_the_import(model_dir: Path, entrypoint: str, says: str) -> None:
    cfg = _config(entrypoint)
    from_source = _error(check_entrypoint_source, cfg, model_dir)
    assert from_source == _error(check_entrypoint, cfg, model_dir)
    assert says in from_source[1]


@pytest.mark.parametrize(
    "entrypoint",
    [
        "model_def:XorTrial",
        "star:XorTrial",
        "patched:P",
        "raises:T",
        "json:JSONDecoder",
        "python3 train.py",
    ],
)
def test_passes_what_only_an_import_can_judge(model_dir: Path, entrypoint: str) -> None:
    """A good trial; a name a star import may bind; a class given train_batch after its
    definition; a module that raises on import; a module installed outside the model
    directory; a script that is there."""
    check_entrypoint_source(_config(entrypoint), model_dir)


def test_the_workers_import_error_is_final_and_names_the_line(model_dir: Path) -> None:
    """What the source check passed and the import refuses, the worker reports as the
    import-based check would, as a TrialError (a step failure that is not retried)."""
    expected = _error(check_entrypoint, _config("raises:T"), model_dir)
    with model_dir_on_path(model_dir), pytest.raises(TrialError) as caught:
        load_trial_class_or_fail("raises:T", model_dir)
    assert (TrialError, str(caught.value)) == expected
    assert "ZeroDivisionError" in expected[1] and "raises.py:3" in expected[1]


def test_a_missing_model_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        check_entrypoint_source(_config("model_def:XorTrial"), tmp_path / "gone")


def test_the_check_imports_neither_the_users_module_nor_torch() -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from det_tasks.config.entered import enter_file\n"
        "from det_tasks.runner.entrypoint_source import check_entrypoint_source\n"
        "folder = Path(sys.argv[1])\n"
        "_, cfg = enter_file(folder / 'killable.yaml', [])\n"
        "check_entrypoint_source(cfg, folder)\n"
        "print(sorted({'torch', 'model_def'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(FLOW_MODEL)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
