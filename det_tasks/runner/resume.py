"""Which checkpoint a trial resumes from: the newest intact one. A corrupted or truncated
newest checkpoint (checksum mismatch, missing file) is reported and skipped in favour of the
previous one, instead of failing every retry of the trial on the same bad bytes."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from det_tasks import checkpoint_format as ckpt
from det_tasks.errors import CheckpointError
from det_tasks.pytorch._restore import open_checkpoint
from det_tasks.storage import CheckpointStore

__all__ = ["choose_resume_checkpoint"]


def choose_resume_checkpoint(
    store: CheckpointStore, candidates: str | Sequence[str] | None
) -> str | None:
    """The first of ``candidates`` (newest first) whose files match their checksums."""
    if candidates is None:
        return None
    if isinstance(candidates, str):
        return candidates  # one checkpoint asked for by name: the loader's error stands
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    problems = []
    for reference in candidates:
        try:
            with open_checkpoint(store, reference) as path:
                ckpt.verify(path)
                ckpt.find_state_file(path)
        except CheckpointError as err:
            problems.append(f"{reference}: {err}")
            print(
                f"warning: checkpoint {reference} is unusable ({err}); trying the previous one",
                file=sys.stderr,
            )
            continue
        return reference
    raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(problems))
