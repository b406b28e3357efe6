"""Fixtures the unit tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A real MLflow store (SQLite) and its folder, for the session: creating the schema
    takes seconds, so tests share one and name their experiments apart."""
    from registry.runs.tracking import client_for

    root = tmp_path_factory.mktemp("mlflow-store")
    return client_for(f"sqlite:///{root / 'mlflow.db'}"), root
