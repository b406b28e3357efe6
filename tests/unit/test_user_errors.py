"""Mistakes a user makes in trial code or its entrypoint: one paragraph naming the file and
line in the user's code, no traceback, exit code 1; `check-config` finds them too; and the
CLI's help reads as plain text."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from det_tasks.runner.cli import _parser, main

FLOW_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "flow_model"

XOR = """
name: {name}
entrypoint: {entrypoint}
hyperparameters:
  global_batch_size: 8
  {lr_key}: 0.1
  hidden: 4
searcher:
  name: single
  metric: validation_loss
  max_length: {{batches: 2}}
"""


def config(tmp_path: Path, entrypoint: str = "model_def:XorTrial", lr_key: str = "learning_rate"):
    model = tmp_path / "model"
    shutil.copytree(FLOW_MODEL, model)
    path = model / "xor.yaml"
    path.write_text(XOR.format(name="xor", entrypoint=entrypoint, lr_key=lr_key))
    return path


def one_paragraph_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_misspelt_hparam_names_the_user_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = config(tmp_path, lr_key="learnign_rate")
    err = one_paragraph_error(capsys, ["run", str(path), "--no-progress"])
    assert "hyperparameter 'learning_rate' is not defined" in err
    assert "learnign_rate" in err  # the keys the config does define
    where = re.search(r"(\S*model_def\.py):(\d+): ", err)
    assert where, err
    source = (path.parent / "model_def.py").read_text().splitlines()
    assert 'get_hparam("learning_rate")' in source[int(where.group(2)) - 1]


def test_wrong_entrypoint_class_is_one_paragraph(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = config(tmp_path, entrypoint="model_def:XorTrail")
    err = one_paragraph_error(capsys, ["run", str(path), "--no-progress"])
    assert "model_def.py has no 'XorTrail'; classes defined there: XorData, XorTrial" in err


def test_check_config_imports_the_entrypoint(tmp_path, capsys):
    good = config(tmp_path)
    assert main(["check-config", str(good)]) == 0
    assert "entrypoint 'model_def:XorTrial' loads (trial class XorTrial)" in capsys.readouterr().err
    (good.parent / "bad.yaml").write_text(
        good.read_text().replace("model_def:XorTrial", "model_def:XorData")
    )
    err = one_paragraph_error(capsys, ["check-config", str(good.parent / "bad.yaml")])
    assert "is not a PyTorchTrial subclass" in err
    (good.parent / "script.yaml").write_text(
        good.read_text().replace("model_def:XorTrial", "python3 train.py")
    )
    err = one_paragraph_error(capsys, ["check-config", str(good.parent / "script.yaml")])
    assert "entrypoint script 'train.py' not found" in err


def test_syntax_error_in_model_def_names_file_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = config(tmp_path)
    model_def = path.parent / "model_def.py"
    model_def.write_text(model_def.read_text() + "\ndef broken(:\n")
    line = len(model_def.read_text().splitlines())
    err = one_paragraph_error(capsys, ["check-config", str(path)])
    assert f"model_def.py:{line}: " in err


def test_help_is_plain_text_and_hides_the_flow_only_flags():
    top = _parser().format_help()
    assert "``" not in top and ":class:" not in top
    run = next(a for a in _parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[
        1
    ].format_help()
    for internal in ("--hparams", "--trial-id", "--experiment-run", "--summary-file"):
        assert internal not in run
    assert "--max-batches" in run  # a flag for people stays


def test_bad_system_metrics_interval_names_the_variable(monkeypatch):
    from det_tasks.errors import ConfigError
    from registry.servers.settings import RegistrySettings

    monkeypatch.setenv("DET_TASKS_SYSTEM_METRICS_INTERVAL", "ten")
    with pytest.raises(ConfigError, match="DET_TASKS_SYSTEM_METRICS_INTERVAL='ten'"):
        RegistrySettings.from_env()
    monkeypatch.setenv("DET_TASKS_SYSTEM_METRICS_INTERVAL", "0")
    assert RegistrySettings.from_env().system_metrics_interval == 0
