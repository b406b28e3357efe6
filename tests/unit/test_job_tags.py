"""A batch job's run tags set by every rank at once: MLflow's SQL store can refuse the second
insert of a new tag (UNIQUE constraint, HTTP 400); the tag is then read back rather than the
job failing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.exceptions import MlflowException

from registry.jobs.batch_jobs import MlflowJobServices


class RacingClient:
    """Refuses the first ``refusals`` set_tag calls; ``other_rank_wrote`` is what another
    rank stored meanwhile (None: nothing)."""

    def __init__(self, refusals: int, other_rank_wrote: str | None) -> None:
        self.refusals = refusals
        self.tags: dict[str, str] = {}
        if other_rank_wrote is not None:
            self.tags["det.uses_checkpoint"] = other_rank_wrote
        self.set_calls = 0

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.set_calls += 1
        if self.refusals:
            self.refusals -= 1
            raise MlflowException("UNIQUE constraint failed: tags.key, tags.run_uuid")
        self.tags[key] = value

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(data=SimpleNamespace(tags=dict(self.tags)))


def _services(client: RacingClient) -> MlflowJobServices:
    services = object.__new__(MlflowJobServices)
    services.client = client  # type: ignore[assignment]
    services.run_id = "run"
    return services


def test_a_tag_another_rank_just_stored_with_the_same_value_is_accepted() -> None:
    client = RacingClient(refusals=1, other_rank_wrote="models:/linear@champion")
    _services(client).set_tag("det.uses_checkpoint", "models:/linear@champion")
    assert client.set_calls == 1 and client.tags == {
        "det.uses_checkpoint": "models:/linear@champion"
    }


def test_a_refusal_that_left_another_value_is_set_again_and_a_second_one_stands() -> None:
    client = RacingClient(refusals=1, other_rank_wrote="models:/linear@old")
    _services(client).set_tag("det.uses_checkpoint", "models:/linear@champion")
    assert client.set_calls == 2 and client.tags["det.uses_checkpoint"] == "models:/linear@champion"
    stubborn = RacingClient(refusals=2, other_rank_wrote=None)
    with pytest.raises(MlflowException):
        _services(stubborn).set_tag("det.uses_checkpoint", "models:/linear@champion")
