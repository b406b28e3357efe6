"""The searcher's state on the experiment's parent run, whatever its size.

A re-run or an activated experiment continues from this state, so it must come back whole.
A searcher's results outgrow one MLflow tag at a few hundred trials (a 1,000-trial search
holds about 30 KB of JSON), and a state cut at the limit is not JSON any more: it is kept
with ``registry.runs.large_tags`` (one readable JSON tag while it fits, else compressed chunks
written in one batch).
"""

from __future__ import annotations

import json
from typing import Any

from registry.runs.large_tags import load_large_tag, save_large_tag
from registry.runs.tracking import retry_mlflow

__all__ = ["STATE_TAG", "load_searcher_state", "save_searcher_state"]

STATE_TAG = "det.searcher_state"


def save_searcher_state(client: Any, run_id: str, state: dict[str, Any]) -> None:
    """Write ``state`` on ``run_id`` (replacing what was there) in one batch of tags."""
    text = json.dumps(state, separators=(",", ":"))
    retry_mlflow(
        lambda: save_large_tag(client, run_id, STATE_TAG, text, "lower searcher.max_trials")
    )


def load_searcher_state(tags: dict[str, str]) -> dict[str, Any] | None:
    """The state saved in a run's ``tags`` (None when there is none)."""
    text = load_large_tag(tags, STATE_TAG)
    if text is None:
        return None
    loaded: dict[str, Any] = json.loads(text)
    return loaded
