"""The searcher's state on the experiment's parent run, whatever its size.

A re-run or an activated experiment continues from this state, so it must come back whole.
One MLflow tag holds at most 8,000 characters; a searcher's results outgrow that at a few
hundred trials (a 1,000-trial search holds about 30 KB of JSON), and a state cut at the
limit is not JSON any more. A state that fits stays one readable JSON tag; a larger one is
compressed and split over numbered tags, all written in one ``log_batch`` (one transaction
on MLflow's SQL stores), so a reader never sees a half-written state.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from mlflow.entities import RunTag

from registry.tracking import _retry

__all__ = ["STATE_TAG", "load_searcher_state", "save_searcher_state"]

STATE_TAG = "det.searcher_state"
_PACKED = "zlib-chunks:"  # STATE_TAG's value when the state is split: the chunk count follows
_TAG_LIMIT = 7_900  # MLflow 3's MAX_TAG_VAL_LENGTH is 8,000
_MAX_CHUNKS = 900  # MLflow takes up to 1,000 entities per log_batch


def _chunk_tag(index: int) -> str:
    return f"{STATE_TAG}.{index}"


def save_searcher_state(client: Any, run_id: str, state: dict[str, Any]) -> None:
    """Write ``state`` on ``run_id`` (replacing what was there) in one batch of tags."""
    text = json.dumps(state, separators=(",", ":"))
    if len(text) <= _TAG_LIMIT:
        tags = [RunTag(STATE_TAG, text)]
    else:
        packed = base64.b64encode(zlib.compress(text.encode(), 9)).decode("ascii")
        chunks = [packed[i : i + _TAG_LIMIT] for i in range(0, len(packed), _TAG_LIMIT)]
        if len(chunks) > _MAX_CHUNKS:
            raise ValueError(
                f"the searcher's state is {len(text)} characters, {len(chunks)} tags "
                f"compressed: more than the {_MAX_CHUNKS} one MLflow batch holds; lower "
                "searcher.max_trials"
            )
        tags = [RunTag(_chunk_tag(i), chunk) for i, chunk in enumerate(chunks, 1)]
        tags.append(RunTag(STATE_TAG, f"{_PACKED}{len(chunks)}"))
    _retry(lambda: client.log_batch(run_id, tags=tags))


def load_searcher_state(tags: dict[str, str]) -> dict[str, Any] | None:
    """The state saved in a run's ``tags`` (None when there is none)."""
    value = tags.get(STATE_TAG)
    if value is None:
        return None
    if not value.startswith(_PACKED):
        loaded: dict[str, Any] = json.loads(value)
        return loaded
    count = int(value[len(_PACKED) :])
    missing = [i for i in range(1, count + 1) if _chunk_tag(i) not in tags]
    if missing:
        raise ValueError(f"the searcher's state lacks tags {[_chunk_tag(i) for i in missing]}")
    packed = "".join(tags[_chunk_tag(i)] for i in range(1, count + 1))
    unpacked: dict[str, Any] = json.loads(zlib.decompress(base64.b64decode(packed)))
    return unpacked
