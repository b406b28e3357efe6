"""When ``python -m flows.experiment`` starts Prefect's server (issue 53): before checking
the command line in a home whose Prefect database is ready (the check imports the user's
trial and torch, which the server's start would wait for), after it in a fresh home, where
bad input must create nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flows.experiment as experiment

ROOT = Path(__file__).resolve().parents[2]
GOOD = [str(ROOT / "tests" / "fixtures" / "flow_model" / "grid.yaml")]
BAD = [*GOOD, "searcher.max_length.batches=-3"]


class FakeServer:
    """Records when it was started, relative to the command line's check."""

    events: list[str] = []

    @classmethod
    def start(cls) -> FakeServer:
        cls.events.append("server started")
        return cls()

    def stop(self) -> None:
        self.events.append("server stopped")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    FakeServer.events = []
    checked = experiment.check_command_line

    def check(argv: list[str]) -> Any:
        FakeServer.events.append("checked")
        return checked(argv)

    monkeypatch.setattr(experiment, "EmbeddedPrefectServer", FakeServer)
    monkeypatch.setattr(experiment, "check_command_line", check)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("DET_TASKS_HOME", str(tmp_path / "det"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return FakeServer.events


def _ready_home(tmp_path: Path) -> None:
    (tmp_path / "prefect").mkdir()
    (tmp_path / "prefect" / "prefect.db").touch()
    (tmp_path / "prefect" / "prefect.db.ready").touch()


def test_a_ready_home_starts_the_server_before_the_check(events: list[str], tmp_path: Path) -> None:
    _ready_home(tmp_path)
    checked, server, warm = experiment._prestart(GOOD)
    assert checked is not None and isinstance(server, FakeServer) and warm is None
    assert events == ["server started", "checked"]


def test_bad_input_in_a_ready_home_stops_the_early_server(
    events: list[str], tmp_path: Path
) -> None:
    _ready_home(tmp_path)
    assert experiment._prestart(BAD) == (None, None, None)
    assert events == ["server started", "checked", "server stopped"]


def test_a_fresh_home_checks_first_and_bad_input_starts_nothing(
    events: list[str], tmp_path: Path
) -> None:
    assert experiment._prestart(BAD) == (None, None, None)
    assert events == ["checked"]
    checked, server, _ = experiment._prestart(GOOD)
    assert checked is not None and isinstance(server, FakeServer)
    assert events == ["checked", "checked", "server started"]
    assert not (tmp_path / "prefect").exists()  # nothing created by the check
