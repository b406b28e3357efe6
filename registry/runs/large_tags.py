"""A run tag that holds text of any size: what the platform writes on a run and reads back
(the experiment's config, the searcher's state) must come back whole.

MLflow keeps at most 8,000 characters of a tag's value (longer ones are cut, or refused by
PostgreSQL's column), and JSON cut short is not JSON. Text that fits stays one plain tag, so
MLflow's UI shows it as it is. Longer text is zlib-compressed, base64-encoded and split over
numbered tags ``NAME.1``, ``NAME.2``...; ``NAME`` then says ``zlib-chunks:<count>``. All of
them go in one write (``create_run``'s tags, or one ``log_batch``: one transaction on
MLflow's SQL stores), so a reader never sees a half-written value. MLflow's client splits a
``log_batch`` of more than 100 tags into several, so one value takes at most 100 tags.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

from mlflow.entities import RunTag

# The readers live with the run records, which the `det` command reads without MLflow.
from registry.runs.run_records import PACKED as _PACKED
from registry.runs.run_records import LargeTagError, load_large_tag, load_large_tags

__all__ = [
    "MAX_CHUNKS",
    "TAG_LIMIT",
    "LargeTagError",
    "large_tag",
    "load_large_tag",
    "load_large_tags",
    "save_large_tag",
]

TAG_LIMIT = 7_900  # MLflow 3's MAX_TAG_VAL_LENGTH is 8,000
MAX_CHUNKS = 99  # with the marker tag, the 100 tags MLflow writes in one batch


def _chunk_name(name: str, index: int) -> str:
    return f"{name}.{index}"


def large_tag(name: str, text: str, fix: str = "shorten it") -> dict[str, str]:
    """The tags that hold ``text`` under ``name``: ``{name: text}`` when it fits one tag,
    else its compressed chunks and the marker. ``fix``: what the user can do when even the
    compressed text is too large (the error says it)."""
    if len(text) <= TAG_LIMIT and not text.startswith(_PACKED):
        return {name: text}
    packed = base64.b64encode(zlib.compress(text.encode(), 9)).decode("ascii")
    chunks = [packed[i : i + TAG_LIMIT] for i in range(0, len(packed), TAG_LIMIT)]
    if len(chunks) > MAX_CHUNKS:
        raise LargeTagError(
            f"{name} is {len(text):,} characters, {len(packed):,} compressed: more than the "
            f"{MAX_CHUNKS} tags of {TAG_LIMIT:,} characters one MLflow write holds; {fix}"
        )
    tags = {_chunk_name(name, i): chunk for i, chunk in enumerate(chunks, 1)}
    tags[name] = f"{_PACKED}{len(chunks)}"
    return tags


def save_large_tag(client: Any, run_id: str, name: str, text: str, fix: str = "shorten it") -> None:
    """Write ``text`` under ``name`` on ``run_id`` (replacing what was there) in one
    ``log_batch``. Chunks of a longer earlier value stay behind, unread."""
    tags = [RunTag(k, v) for k, v in large_tag(name, text, fix).items()]
    client.log_batch(run_id, tags=tags)
