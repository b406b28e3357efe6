"""The stack's MLflow server runs on uvloop: it is named on the server's command line, and
an environment without it (installed before uvloop was a dependency) is told so before
anything starts, with the fix."""

from __future__ import annotations

import importlib.util
import shlex

import pytest

from infra import stack
from infra.services import ServiceError
from infra.stack import StackConfig, mlflow_service


def test_the_mlflow_server_is_started_on_uvloop(tmp_path):
    argv = mlflow_service(StackConfig(root=tmp_path)).argv
    uvicorn_opts = shlex.split(argv[argv.index("--uvicorn-opts") + 1])
    assert uvicorn_opts[uvicorn_opts.index("--loop") + 1] == "uvloop"


def test_without_uvloop_up_says_what_to_install_and_starts_nothing(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        stack.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "uvloop" else real_find_spec(name, *a),
    )
    started = []
    monkeypatch.setattr(stack, "start", lambda *a, **k: started.append(a))
    monkeypatch.setattr(stack, "start_all", lambda *a, **k: started.append(a))
    with pytest.raises(ServiceError, match=r"uvloop is not installed .*`make install`"):
        stack.up(StackConfig(root=tmp_path / "stack"))
    assert started == []
    assert not (tmp_path / "stack").exists()
