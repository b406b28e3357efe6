"""Searchers take their length in any unit the config allows: ``Length.counted`` (the one
rule) turns records, and epochs with ``records_per_epoch``, into the batches their rungs are
placed in; an epoch length without ``records_per_epoch`` is refused when the config is read
(check-config), in one line. Before, ASHA and Optuna's pruner refused every non-batch length
when the experiment started."""

from __future__ import annotations

from typing import Any

import pytest

from det_tasks.config import Length, parse_config
from det_tasks.errors import ConfigError
from det_tasks.searchers.choose import make_searcher


@pytest.mark.parametrize(
    ("length", "gbs", "records_per_epoch", "expected"),
    [
        ({"batches": 200}, 32, None, 200),
        ({"records": 6400}, 32, None, 200),
        ({"epochs": 2}, 32, 3200, 200),
        ({"epochs": 2}, 32, None, None),  # the data loader's epochs: known only at run time
        ({"records": 10}, 32, None, 1),  # never zero batches
    ],
)
def test_in_batches_known_answers(
    length: dict[str, int], gbs: int, records_per_epoch: int | None, expected: int | None
) -> None:
    assert Length(**length).in_batches(gbs, records_per_epoch) == expected


def _config(length: dict[str, int], records_per_epoch: int | None = None, **searcher: Any) -> Any:
    raw: dict[str, Any] = {
        "entrypoint": "model_def:Trial",
        "hyperparameters": {
            "global_batch_size": 32,
            "lr": {"type": "double", "minval": 0.01, "maxval": 1.0},
        },
        "searcher": {
            "metric": "loss",
            "max_trials": 8,
            "max_length": length,
            "name": "adaptive_asha",
            **searcher,
        },
        "reproducibility": {"experiment_seed": 3},
    }
    if records_per_epoch is not None:
        raw["records_per_epoch"] = records_per_epoch
    return parse_config(raw)


@pytest.mark.parametrize(
    ("length", "records_per_epoch"), [({"records": 6400}, None), ({"epochs": 2}, 3200)]
)
def test_asha_places_its_rungs_alike_for_the_same_length_in_any_unit(
    length: dict[str, int], records_per_epoch: int | None
) -> None:
    in_batches = make_searcher(_config({"batches": 200}))
    other = make_searcher(_config(length, records_per_epoch))
    first = in_batches.start()
    assert other.start() == first
    assert sorted({w.batches for w in first}) == [50, 200]  # brackets' first rungs: 200/4, 200


def test_asha_with_epochs_and_no_records_per_epoch_is_refused_when_read() -> None:
    with pytest.raises(ConfigError) as err:
        _config({"epochs": 2})
    text = str(err.value)
    assert "\n" not in text
    assert text == (
        "config: searcher adaptive_asha places its rungs in batches, and a length of "
        "{epochs: 2} has a number of batches only with records_per_epoch: add "
        "records_per_epoch (the training records in one epoch), or give the length in "
        "batches or records"
    )


def test_optunas_pruner_counts_in_batches_and_without_it_epochs_are_fine() -> None:
    pytest.importorskip("optuna")
    with pytest.raises(ConfigError, match="searcher optuna places its rungs in batches"):
        _config({"epochs": 2}, name="optuna")
    converted = make_searcher(_config({"records": 6400}, name="optuna", max_concurrent_trials=2))
    in_batches = make_searcher(_config({"batches": 200}, name="optuna", max_concurrent_trials=2))
    first = converted.start()
    assert first == in_batches.start()
    assert [w.batches for w in first] == [3, 3]  # the first of rungs 3, 12, 50, 200 (200/4**3)
    unpruned = _config({"epochs": 2}, name="optuna", pruner="none")
    assert [w.batches for w in make_searcher(unpruned).start()][:1] == [None]


def test_the_flow_knows_a_trials_last_segment_in_batches_whatever_the_unit() -> None:
    """The flow releases a held trial after its last segment: with max_length in records,
    ASHA's top rung (200 batches) is that segment, not a rung of 6,400 batches."""
    from det_tasks.searchers.base import Work
    from flows.chains import final_segment

    config = _config({"records": 6400})
    assert final_segment(Work(1, {}, 200), config)
    assert not final_segment(Work(1, {}, 50), config)
    assert final_segment(Work(1, {}, None), config)
