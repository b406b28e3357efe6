"""A tag that holds text of any size (registry.runs.large_tags), through a real MLflow store
(SQLite): what fits stays one plain tag, longer text comes back whole from compressed
chunks, and every tag MLflow stores stays within its 8,000-character limit."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import pytest

from registry.runs.large_tags import (
    MAX_CHUNKS,
    TAG_LIMIT,
    LargeTagError,
    large_tag,
    load_large_tag,
    load_large_tags,
    save_large_tag,
)
from registry.runs.tracking import CONFIG_TAG, ExperimentRuns, experiment_config

MLFLOW_TAG_LIMIT = 8_000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH


def _text(length: int, seed: int = 0) -> str:
    """Text that barely compresses (random letters and digits): the most chunks."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(length))


@pytest.fixture(scope="module")
def store(mlflow_store: tuple[Any, Path]) -> tuple[Any, str]:
    client, root = mlflow_store
    return client, client.create_experiment("large-tags", artifact_location=root.as_uri())


@pytest.fixture(autouse=True)
def artifact_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """New experiments' artifacts in the test's folder (MLflow's default: ./mlruns)."""
    monkeypatch.setenv("DET_TASKS_ARTIFACT_ROOT", str(tmp_path / "artifacts"))


def _run(store: tuple[Any, str]) -> str:
    client, experiment_id = store
    return str(client.create_run(experiment_id).info.run_id)


@pytest.mark.parametrize("length", [0, 7_900, 8_001, 100_000])
def test_text_comes_back_whole_from_a_real_store(store: tuple[Any, str], length: int) -> None:
    client, _ = store
    run_id = _run(store)
    text = _text(length)
    save_large_tag(client, run_id, "det.big", _text(length // 2, seed=1))  # earlier, smaller
    save_large_tag(client, run_id, "det.big", text)
    tags = client.get_run(run_id).data.tags
    assert load_large_tag(tags, "det.big") == text
    assert all(len(v) <= MLFLOW_TAG_LIMIT for v in tags.values())
    if length <= TAG_LIMIT:
        assert tags["det.big"] == text  # readable as it is in MLflow's UI
    else:
        assert tags["det.big"].startswith("zlib-chunks:")
        assert int(tags["det.big"].split(":")[1]) == len(large_tag("det.big", text)) - 1


def test_a_missing_tag_is_none_and_a_plain_one_is_itself() -> None:
    assert load_large_tag({"other": "x"}, "det.big") is None
    assert load_large_tag({"det.big": '{"a": 1}'}, "det.big") == '{"a": 1}'


def test_text_that_looks_like_the_marker_is_packed_not_misread() -> None:
    text = "zlib-chunks:3"
    tags = large_tag("det.big", text)
    assert tags["det.big"] != text and load_large_tag(tags, "det.big") == text


def test_broken_chunks_fail_loudly_naming_the_tag() -> None:
    tags = large_tag("det.big", _text(20_000))
    del tags["det.big.2"]
    with pytest.raises(LargeTagError, match=r"det\.big is split over 3 tags; \['det\.big\.2'\]"):
        load_large_tag(tags, "det.big")
    with pytest.raises(LargeTagError, match="do not decompress"):
        load_large_tag({"det.big": "zlib-chunks:1", "det.big.1": "not base64!"}, "det.big")


def test_text_past_one_batch_is_refused_with_the_fix() -> None:
    too_long = _text(TAG_LIMIT * (MAX_CHUNKS + 2))  # base64 of random text outgrows it
    with pytest.raises(LargeTagError, match=r"det\.big is .* one MLflow write holds; lower it"):
        large_tag("det.big", too_long, "lower it")


def test_prefixed_records_skip_chunks_even_once_their_tag_is_deleted(
    store: tuple[Any, str],
) -> None:
    client, _ = store
    run_id = _run(store)
    small, big = json.dumps({"uuid": "a"}), json.dumps({"uuid": "b", "pad": _text(20_000)})
    save_large_tag(client, run_id, "det.checkpoint.a", small)
    save_large_tag(client, run_id, "det.checkpoint.b", big)
    tags = client.get_run(run_id).data.tags
    assert load_large_tags(tags, "det.checkpoint.") == {
        "det.checkpoint.a": small,
        "det.checkpoint.b": big,
    }
    client.delete_tag(run_id, "det.checkpoint.b")  # as GC forgets a record
    left = client.get_run(run_id).data.tags
    assert "det.checkpoint.b.1" in left
    assert load_large_tags(left, "det.checkpoint.") == {"det.checkpoint.a": small}


def test_an_experiment_config_of_30_kb_comes_back_whole(store: tuple[Any, str]) -> None:
    """The parent run is created with the whole config (it used to be cut at 7,900
    characters, and GC then failed to parse it)."""
    client, _ = store
    config = {
        "name": "large",
        "description": _text(9_000),
        "hyperparameters": {
            "word": {"type": "categorical", "vals": [_text(16, i) for i in range(1800)]}
        },
        "checkpoint_storage": {"save_trial_latest": 2},
    }
    assert len(json.dumps(config)) > 30_000
    runs = ExperimentRuns(client, "large-config", "key-30kb", config)
    tags = client.get_run(runs.parent_run_id).data.tags
    assert experiment_config(tags) == config
    assert all(len(v) <= MLFLOW_TAG_LIMIT for v in tags.values())
    small = ExperimentRuns(client, "large-config", "key-small", {"name": "s"})
    assert json.loads(client.get_run(small.parent_run_id).data.tags[CONFIG_TAG]) == {"name": "s"}


def test_runs_made_before_the_tag_have_an_empty_config() -> None:
    assert experiment_config({}) == {}


def test_a_description_past_mlflows_experiment_tag_limit_is_cut_for_the_ui_only(
    store: tuple[Any, str],
) -> None:
    """MLflow refuses experiment tags over 20,000 characters: the UI's note is cut, the
    config keeps the whole description."""
    client, _ = store
    description = _text(25_000)
    runs = ExperimentRuns(client, "long-description", "key-desc", {"description": description})
    note = client.get_experiment(runs.experiment_id).tags["mlflow.note.content"]
    assert len(note) <= 20_000 and note.startswith(description[:19_000])
    assert note.endswith("the whole description is in the runs' det.config tag)")
    config = experiment_config(client.get_run(runs.parent_run_id).data.tags)
    assert config["description"] == description
