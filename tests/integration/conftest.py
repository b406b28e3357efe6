"""The real local stack (SeaweedFS + MLflow server), started once per test session by the
project's own infra/ code on ports of its own, and stopped at the end."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import StackConfig, down, mlflow_service, up


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    pytest.importorskip("mlflow", reason="the platform extra is not installed")
    root = tmp_path_factory.mktemp("stack")
    config = StackConfig(
        root=root,
        s3_port=28333,
        master_port=29334,
        volume_port=28181,
        filer_port=28989,
        mlflow_port=25001,
    )
    saved = dict(os.environ)
    env = up(config)
    os.environ.update(env)
    os.environ["DET_TASKS_CACHE_DIR"] = str(root / "cache")
    try:
        yield config
    finally:
        down(config)
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def mlflow_server(stack: StackConfig):
    return mlflow_service(stack)


@pytest.fixture
def model_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "fixtures" / "determined_model"
